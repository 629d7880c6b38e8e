"""Consistency cases: a subject against itself between equivalent call paths. Prefill row t == decode at
t (dense and sparse), absorbed MLA == naive MLA (a subject with both prefill and mla-decode); chunked ==
unchunked is the `chunked` case itself (context chunks merged by the subject's own LSE)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...outcomes import AttentionReply
from ...reference import attention_cases as ref
from ...reference import mla as mla_ref
from .. import metrics
from ..base import Finding
from .attention_budgets import F32_RULE, FLOOR_SEEDS, K_FLOOR, f32_budget
from .attention_calls import AttentionKernel, run_case
from .attention_inputs import make_inputs, rounded
from .attention_reference import reference
from .attention_shapes import Shape
from .attention_suite import TOPK, Case
from .attention_verdicts import CHECK


def consistency(kernel: AttentionKernel, shape: Shape, dtype: torch.dtype, dtype_name: str, subject: str,
                contracts: set[str], seed: int, dev: str = "cpu") -> list[Finding]:
    """prefill row t == decode at t (dense and sparse); absorbed MLA == naive MLA (when the subject has
    both contracts)."""
    out: list[Finding] = []
    if "prefill" in contracts:
        L = 29
        full = Case("prefill-vs-decode", "prefill", ((L, L),))
        rows = (0, L // 2, L - 1)
        step = Case("prefill-vs-decode", "prefill", tuple((1, t + 1) for t in rows))
        out.append(_pair(kernel, shape, dtype, dtype_name, subject, "prefill-row-vs-decode", full, step,
                         lambda xa: _decode_inputs(xa, rows), lambda o: o[list(rows)], seed, dev))
    if "prefill" in contracts and "mla-decode" in contracts and shape.mla:
        out.append(_absorbed_vs_naive(kernel, shape, dtype, dtype_name, subject, seed, dev))
    if {"mla-sparse-prefill", "mla-sparse-decode"} <= contracts and shape.top_k:
        t, n, k = 9, 40, min(shape.top_k, TOPK)
        rows = (0, t // 2, t - 1)
        full = Case("sparse-prefill-vs-decode", "mla-sparse-prefill", ((t, n),), top_k=k)
        step = Case("sparse-prefill-vs-decode", "mla-sparse-decode", tuple((1, n - t + r + 1) for r in rows), top_k=k)
        out.append(_pair(kernel, shape, dtype, dtype_name, subject, "sparse-prefill-row-vs-decode", full, step,
                         lambda xa: _sparse_decode_inputs(xa, rows, n - t), lambda o: o[list(rows)], seed, dev))
    return out


def _sparse_decode_inputs(x: dict[str, torch.Tensor], rows: tuple[int, ...], ctx: int) -> dict[str, torch.Tensor]:
    """The sparse decode steps of the given query rows of a one-sequence sparse prefill (same cache,
    same top-k rows; query r sits at position ctx + r, so its seq_len is ctx + r + 1)."""
    dev = x["q"].device
    return {"q": x["q"][list(rows)], "kv_cache": x["kv_cache"], "block_table": x["block_table"][[0] * len(rows)],
            "seq_lens": torch.tensor([ctx + r + 1 for r in rows], dtype=torch.int32, device=dev),
            "cu_q": torch.arange(len(rows) + 1, dtype=torch.int32, device=dev), "topk": x["topk"][list(rows)]}


def _decode_inputs(x: dict[str, torch.Tensor], rows: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The decode-step inputs of the given rows of a one-sequence causal prefill."""
    k = torch.cat([x["k"][: t + 1] for t in rows])
    v = torch.cat([x["v"][: t + 1] for t in rows])
    lens = torch.tensor([t + 1 for t in rows], device=k.device)
    return {"q": x["q"][list(rows)], "k": k, "v": v,
            "cu_q": torch.arange(len(rows) + 1, dtype=torch.int32, device=k.device),
            "cu_k": torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)}


def _pair(kernel, shape, dtype, dtype_name, subject, name, case_a, case_b, derive, select, seed, dev) -> Finding:
    """Two subject calls that must agree. float32: within the sum of the two calls' rounding bounds on
    these inputs; otherwise K_FLOOR x max over seeds of the summed emulation errors."""
    xa = make_inputs(shape, case_a, seed, dev)
    if dtype == torch.float32:
        limit = select(f32_budget(shape, case_a, xa)[0]) + f32_budget(shape, case_b, derive(xa))[0]
    else:
        floor = 0.0
        for s in range(FLOOR_SEEDS):
            xs = make_inputs(shape, case_a, 20_000 + s, dev)
            xb = derive(xs)
            ea = select(reference(shape, case_a, rounded(xs, dtype), p_dtype=dtype, out_dtype=dtype)[0])
            eb = reference(shape, case_b, rounded(xb, dtype), p_dtype=dtype, out_dtype=dtype)[0]
            wa = select(reference(shape, case_a, xs)[0])
            floor = max(floor, float(((ea - wa).abs() + (eb - wa).abs()).max()))
        limit = K_FLOOR * floor
    ga, gb = run_case(kernel, shape, case_a, xa, dtype), run_case(kernel, shape, case_b, derive(xa), dtype)
    return _agree(subject, f"{name}/{dtype_name}", ga, gb, select, limit, dtype_name)


def _agree(subject: str, target: str, ga: AttentionReply, gb: AttentionReply, select: Optional[Callable], limit: Any,
           dtype_name: str) -> Finding:
    """limit: per-element tensor (float32: the two paths' summed rounding bounds) or K_FLOOR x floor."""
    info = {"dtype": dtype_name, "consistency": True}
    bad = next((g for g in (ga, gb) if g.status != "ok"), None)
    if bad is not None:
        status = "skip" if bad.status in ("unsupported", "transport") else "fail"
        return Finding(CHECK, subject, target, status, reason=f"{bad.status}: {bad.message}", metrics=info)
    a, b = select(ga.out.double()) if select else ga.out.double(), gb.out.double()
    d = metrics.max_abs_diff(a, b)
    if isinstance(limit, torch.Tensor):
        ok = not metrics.over_budget(a, b, limit.reshape(-1)).any()
        words, rule = f"the two calls' float32 rounding bounds (max {float(limit.max()):.3g})", F32_RULE + ", summed"
        bud = {"rule": rule, "bound_max": float(limit.max())}
    else:
        ok = not (torch.isnan(a).any() or torch.isnan(b).any()) and d <= limit
        words = f"budget {K_FLOOR:g} x {limit / K_FLOOR:.3g}"
        bud = {"rule": f"{K_FLOOR:g} x max over seeds of the two rounded emulations' summed errors",
               "floor": limit / K_FLOOR}
    return Finding(CHECK, subject, target, "pass" if ok else "fail",
                   reason=f"the two paths differ by {d:.3g} ({words})", metrics={**info, "max_abs_diff": d},
                   budget=bud, explanation="" if ok else "the subject disagrees with itself between two equivalent call paths")


def _absorbed_vs_naive(kernel: AttentionKernel, shape: Shape, dtype: torch.dtype, dtype_name: str, subject: str,
                       seed: int, dev: str) -> Finding:
    """Decode of B sequences as naive MLA (prefill on decompressed K/V) and absorbed MLA (mla-decode on the
    latent cache, then v_b): both must give the same [B, H, Dv]."""
    m = shape.mla
    dec = Case("absorbed", "mla-decode", ((1, 21), (1, 40)))
    naive_case = Case("naive", "prefill", dec.seqs)

    def build(s: int) -> tuple[dict, dict, torch.Tensor]:
        gen = torch.Generator().manual_seed(s)
        x = make_inputs(shape, dec, s)  # drawn and built on the CPU, moved below
        k_b = torch.randn(shape.n_head, m.kv_lora_rank, m.qk_nope, generator=gen, dtype=torch.float64) / m.kv_lora_rank ** 0.5
        v_b = torch.randn(shape.n_head, m.v_dim, m.kv_lora_rank, generator=gen, dtype=torch.float64) / m.kv_lora_rank ** 0.5
        q_nope = torch.randn(len(dec.seqs), shape.n_head, m.qk_nope, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(len(dec.seqs), shape.n_head, m.qk_rope, generator=gen, dtype=torch.float64)
        x["q"] = mla_ref.absorb_q(q_nope, q_pe, k_b)  # [B, H, R+Dr]
        ks, vs = [], []
        for b, (_, n) in enumerate(dec.seqs):
            rows = ref.gather_pages(x["kv_cache"], x["block_table"][b], n)  # [n, R+Dr]
            k_nope, v = mla_ref.decompress(rows[:, :m.kv_lora_rank], k_b, v_b)
            ks.append(torch.cat([k_nope, rows[:, None, m.kv_lora_rank:].expand(-1, shape.n_head, -1)], -1))
            vs.append(v)
        lens = torch.tensor([n for _, n in dec.seqs])
        xn = {"q": torch.cat([q_nope, q_pe], -1), "k": torch.cat(ks), "v": torch.cat(vs), "cu_q": x["cu_q"],
              "cu_k": torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)}
        return ({n: t.to(dev) for n, t in x.items()}, {n: t.to(dev) for n, t in xn.items()}, v_b.to(dev))

    def up(o: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhr,hvr->bhv", o, v_b)

    x, xn, v_b = build(seed)
    if dtype == torch.float32:  # the latent bound carried through |v_b| (the up-projection is ours, float64)
        limit = up(f32_budget(shape, dec, x)[0], v_b.abs()) + f32_budget(shape, naive_case, xn)[0]
    else:
        floor = 0.0
        for s in range(FLOOR_SEEDS):
            xs, xns, v_bs = build(20_000 + s)
            want = reference(shape, naive_case, xns)[0]
            ea = up(reference(shape, dec, rounded(xs, dtype), p_dtype=dtype, out_dtype=dtype)[0], v_bs)
            en = reference(shape, naive_case, rounded(xns, dtype), p_dtype=dtype, out_dtype=dtype)[0]
            floor = max(floor, float(((ea - want).abs() + (en - want).abs()).max()))
        limit = K_FLOOR * floor
    ga = run_case(kernel, shape, dec, x, dtype)
    gn = run_case(kernel, shape, naive_case, xn, dtype)
    if ga.status == "ok":
        ga.out = up(ga.out.double(), v_b)
    return _agree(subject, f"absorbed-vs-naive/{dtype_name}", ga, gn, None, limit, dtype_name)
