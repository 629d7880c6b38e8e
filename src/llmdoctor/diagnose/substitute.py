"""Op substitution, once: rerun the reference with one component of the engine swapped in (its arithmetic, its
dequant kernel, its attention kernel, a weight as it holds it) and ask whether that swap alone reproduces the
engine's divergence at its first divergent point. Every swap is judged by the one rule below."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .session import Session

# A swap reproduces the divergence when its error at the point is at least half the engine's, or non-finite
# like the engine's. Why half: the point diverges, so the engine's error exceeds K = 3 times the emulated run's
# noise (checks/compute/layers.py), and half of it exceeds 1.5x that noise. A swap that carries the whole fault
# misses only the engine's other rounding, about one noise, at most a third of the error: it lands above 2/3 of
# it. A swap that does not carry it shows its own rounding only, about one noise: below 1.5x. Half lies between.
REPRODUCES_AT = 0.5


def reproduces(error: float, engine_error: float) -> bool:
    """The one rule of substitution: `error` (the swapped run's at the point) >= REPRODUCES_AT x `engine_error`,
    or both non-finite."""
    if not math.isfinite(error):
        return not math.isfinite(engine_error)
    return error >= REPRODUCES_AT * engine_error


def substitute(s: Session, point, swap: str, rerun: Callable[[set[str]], dict]) -> dict[str, Any]:
    """Rerun the reference with one component swapped (`rerun(capture)`: that run's captures of the capture
    points) and judge it at `point` (a checks/compute/layers.py CurvePoint) against the float32 reference:
    {"swap", "reproduces", "error"}; a swapped-in component that crashes is evidence too, not our failure
    ({"reproduces": None, "error": None, "could_not_run": why})."""
    from ..checks import metrics as M

    name = f"{point.point}-{point.layer}"
    try:
        caps = rerun({name})
    except Exception as e:  # the suspect may fail in any way: that is evidence too, reported
        return {"swap": swap, "reproduces": None, "error": None, "could_not_run": f"{type(e).__name__}: {e}"}
    if name not in caps:
        return {"swap": swap, "reproduces": False, "error": math.nan}
    err = M.rel_l2(caps[name], s.reference("float32")[1][name])
    return {"swap": swap, "reproduces": reproduces(err, point.error), "error": err}


def substitutions(s: Session, point) -> list[dict[str, Any]]:
    """The arithmetic swaps: the engine's precision (the emulated run, already computed), the --dequant-kernel,
    and the --attention-impl under the prefill contract (dense models), each through `substitute`."""
    out = [substitute(s, point, f"the engine's {s.budget().words}", lambda capture: s.budget_reference()[1])]
    if s.inputs.dequant_kernel and s.inputs.gguf is not None:
        kernel = s.inputs.dequant_kernel

        def with_kernel(capture: set[str]) -> dict:
            from ..reference import load
            from ..subjects.substitution import KernelDequantizer

            with KernelDequantizer(kernel) as kd, load(s.inputs.gguf, dequantizer=kd) as model, s.pinned_threads():
                return model.forward(s.tokens(), capture=capture, extra=s.replayed_choices())[1]

        s.progress(f"reference with the dequant kernel {kernel!r} swapped in")
        out.append(substitute(s, point, f"the dequant kernel {kernel!r}", with_kernel))
    if s.inputs.attention_impl and (s.inputs.attention_contract or "prefill") == "prefill" and s.config().mla is None:
        impl = s.inputs.attention_impl

        def with_attention(capture: set[str]) -> dict:
            from ..subjects.substitution import PrefillAttention

            with PrefillAttention(impl) as swapped, s.pinned_threads():
                return s.model().forward(s.tokens(), capture=capture, attention=swapped, extra=s.replayed_choices())[1]

        s.progress(f"reference with the attention kernel {impl!r} swapped in")
        out.append(substitute(s, point, f"the attention kernel {impl!r}", with_attention))
    return out


def held_weights(s: Session, point) -> dict[str, Any]:
    """The divergent layer's weights as the engine holds them after its loader, against the file's mapped
    into the engine's layout (gguf/layout.py): {"compared": n, "differ": [{tensor, kind, words, reproduces,
    swap_error}]} or {"skipped": why}. A differing tensor (the first two) is confirmed by `substitute`: the
    reference run with the engine's version of it (mapped back to the file's layout)."""
    from ..checks.compute.weight_relation import relate
    from ..gguf import layout
    from ..subjects.engines.base import EngineError, EngineUnavailable, NotOffered

    if s.inputs.gguf is None:
        return {"skipped": "the reference reads the engine's own checkpoint"}
    try:
        held, config = s.engine().weights(point.layer)
    except NotOffered as e:
        return {"skipped": str(e)}
    except (EngineError, EngineUnavailable) as e:  # the divergence stands; only its weights could not be read
        return {"skipped": f"the engine's loaded weights could not be read: {e}", "unread": True}
    cfg, g = s.config(), s.gguf()
    legacy_kv_b = cfg.mla is not None and g.has_tensor(f"blk.{point.layer}.attn_kv_b.weight")
    plan = layout.plan(cfg.arch, list(held), config, split_kv_b=not legacy_kv_b)
    weights = s.model().weights
    # the engine's storage precision: bfloat16/float16 weights differ from the file's by their rounding
    tol = {"bfloat16": 2.0**-8, "float16": 2.0**-11}.get(s.inputs.engine_dtype or "", 1e-6)
    rules = [r for r in plan.rules if all(n in held for n in r.sources) and all(weights.has(t) for t in r.targets)]
    want = layout.to_hf(layout.Plan(plan.arch, rules, [], {}), {t: weights.get(t) for r in rules for t in r.targets})
    n_head = {"q_proj": cfg.n_head, "k_proj": cfg.n_head_kv}
    differ = []
    for name, w in want.items():
        proj = name.split(".")[-2]
        rel = relate(held[name], w.cpu().numpy(), tol=tol, n_head=n_head.get(proj) if cfg.arch == "llama" else None,
                     others={o: v.cpu().numpy() for o, v in want.items() if o != name and v.shape == w.shape})
        if rel is not None:
            differ.append({"tensor": name, **rel})
    for d in differ[:2]:
        rule = next(r for r in rules if d["tensor"] in r.sources)
        swapped = layout.to_gguf(layout.Plan(plan.arch, [rule], [], {}),
                                 {src: torch.as_tensor(held[src]) for src in rule.sources})

        def with_weight(capture: set[str], swapped: dict = swapped) -> dict:
            from ..reference import load

            with load(s.reference_path(), cache=True) as model:
                for t, value in swapped.items():
                    model.weights.replace(t, value)
                with s.pinned_threads():
                    return model.forward(s.tokens(), capture=capture, extra=s.replayed_choices())[1]

        s.progress(f"reference with the engine's {d['tensor']} swapped in")
        got = substitute(s, point, d["tensor"], with_weight)
        d["reproduces"], d["swap_error"] = got["reproduces"], got["error"]
        if "could_not_run" in got:
            d["could_not_run"] = got["could_not_run"]
    return {"compared": len(want), "differ": differ}
