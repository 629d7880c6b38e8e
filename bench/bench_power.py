"""Power on every planted fault (issue 35 item 2): each fault of the registry (src/llmdoctor/faults/), planted the
way the tests plant it, and what the check that judges it says.

Table 1, `diagnose`: the demo faults (llmdoctor.faults.demo.apply, as `diagnose --demo-fault NAME`), the decode
faults (faults/decode.py, as tests/diagnose/test_decode_path.py and test_decode_choices.py plant them) and the
tiny-model engine and file faults the tests diagnose with dg.run (checkpoint-scaled-tensor, head-count-kv-3, and
the engine copies and loader plants of tests/checks/compute/test_moe_routing.py / test_weight_relation.py, marked
"test plant": not registry entries). Per fault: what its test expects named (check, layer, op), what the
diagnosis named (the top suspect; beside a check without layers of its own, the failing layer localization's layer
and op), found (the expected check fails at the expected layer and op; the top suspect itself where the test
requires it), and the margin: each failing criterion of the judged finding over its allowance (the "x its
allowance" of the findings), marginal within 2x; "exact" for a check without an allowance.

Table 2, the other commands: dequant and attention kernels (check dequant / check attention), file corruptions
(check forensics), name maps (check mapping), hostile files (inspect), tokenizer folders (the front-end check),
sharding (check sharding), run here when cheap; endpoint and reference-side faults say which test judges them.

    HF_HUB_OFFLINE=1 python bench/bench_power.py [--only NAME[,NAME]] [--list] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
for p in ("tests", "tests/reference", "tests/diagnose", "tests/checks/compute", "tests/checks/kernels",
          "tests/checks/layout", "tests/checks/endpoint"):
    sys.path.insert(0, str(ROOT / p))

from llmdoctor import diagnose as dg  # noqa: E402
from llmdoctor import faults  # noqa: E402
from llmdoctor.checks.compute.allowance import marginal  # noqa: E402
from llmdoctor.demo import model_path  # noqa: E402


# ---- what a test expects named, and what a diagnosis named ----------------------------------------------------

@dataclass(frozen=True)
class Expect:
    check: str
    says: str = ""  # a substring of that finding's explanation
    layer: int | str | None = None  # "any": some layer must be named
    op: str | None = None  # a substring of the named op (point, cause or swap)
    top: bool = True  # the test requires the check to be the top-ranked suspect
    note: str = ""

    def words(self) -> str:
        layer = "" if self.layer is None else f" @ layer {self.layer}"
        return f"{self.check}{layer}" + (f" / {self.op}" if self.op else "") + ("" if self.top else " (not top)")


def where(f, findings) -> tuple[Any, str | None]:
    """(layer, op) a finding names: its own for the layer-wise checks, else the failing layer localization's."""
    m = f.metrics or {}
    if f.check == "layer-localization" and f.status == "fail":
        return m.get("first_divergent_layer"), f"{m.get('point')}" + (f" ({m['cause']})" if m.get("cause") else "")
    if f.check == "decode-path":
        loc = m.get("localization") or {}
        return loc.get("layer"), loc.get("point")
    if "first_layer" in m:
        return m["first_layer"], None
    loc = next((g for g in findings if g.check == "layer-localization" and g.status == "fail"), None)
    return (None, None) if loc is None else where(loc, findings)


def criteria(f) -> list[dict]:
    if f.check == "decode-path":
        return (f.evidence or [{}])[0].get("decode", [])
    return [e for e in f.evidence or [] if isinstance(e, dict) and "criterion" in e and "ratio" in e]


def margins(f) -> list[tuple[float, str]]:
    """(ratio, criterion) of a finding's failing criteria over their allowances, worst first (its worst passing one
    if none fails); [] for an exact check (bytes, metadata, a set test)."""
    m = f.metrics or {}
    if f.check == "layer-localization":
        r = m.get("ratio", m.get("worst_ratio"))
        return [] if r is None else [(r, m.get("point") or m.get("worst") or "points")]
    crit = criteria(f)
    failing = sorted(((c["ratio"], c["criterion"]) for c in crit if not c["ok"]), reverse=True)
    pts = m.get("decode_points") or {}
    if f.check == "decode-path" and pts.get("first_divergent_layer") is not None:  # the decode steps' activations
        failing = sorted(failing + [(pts["worst_ratio"], f"decode point {pts['worst']}")], reverse=True)
    return failing or sorted(((c["ratio"], c["criterion"]) for c in crit), reverse=True)[:1]


def fmt_ratios(rs: list[tuple[float, str]]) -> str:
    if not rs:
        return "exact"
    return ", ".join(f"{c} " + (f"{r:.3g}x" if math.isfinite(r) else "non-finite") + (" marginal" if marginal(r) else "")
                     for r, c in rs)


def judge(res, expect: Expect) -> dict:
    """The row's verdict fields from a finished diagnosis."""
    top = res.suspects[0] if res.suspects else None
    if expect.top:
        f = top
    else:
        f = next((g for g in res.findings if g.check == expect.check and g.status == "fail"), None)
    layer, op = where(f, res.findings) if f is not None else (None, None)
    found = (f is not None and f.check == expect.check and expect.says in (f.explanation or "")
             and (expect.layer is None or (layer is not None if expect.layer == "any" else layer == expect.layer))
             and (expect.op is None or expect.op in (op or "")))
    judged = f or next((g for g in res.findings if g.check == expect.check), None)
    t_layer, t_op = where(top, res.findings) if top is not None else (None, None)
    others = [f"{g.check}: {fmt_ratios(margins(g))}" for g in res.findings
              if g.status == "fail" and g is not judged and margins(g)]
    return {"named": "none (healthy)" if top is None else
            f"{top.check}" + ("" if t_layer is None else f" @ layer {t_layer}") + (f" / {t_op}" if t_op else ""),
            "found": "yes" if found else "no", "exit_code": res.exit_code,
            "judged_status": None if judged is None else judged.status,
            "margin": None if judged is None else fmt_ratios(margins(judged)),
            "ratio": None if judged is None or not margins(judged) else margins(judged)[0][0],
            "other_ratios": "; ".join(others), "verdict": res.verdict[:400]}


# ---- fixtures (built once, under the work folder) --------------------------------------------------------------

class Fixtures:
    def __init__(self, work: Path):
        self.work, self._made = work, {}

    def _once(self, key: str, build: Callable[[Path], Any]) -> Any:
        if key not in self._made:
            out = self.work / "fixtures" / key
            out.mkdir(parents=True, exist_ok=True)
            self._made[key] = build(out)
        return self._made[key]

    def hf(self, kind: str) -> tuple[Path, Path]:
        """(checkpoint, F32 GGUF) of tests/fixtures_hf.py."""
        import fixtures_hf

        return self._once(f"hf-{kind}", lambda out: fixtures_hf.checkpoint(kind, out))

    def mla(self, kind: str, **over) -> Any:
        import fixtures_mla

        key = f"mla-{kind}" + ("-runnable" if over else "")
        return self._once(key, lambda out: fixtures_mla.build(kind, out, **over))

    def demo_tokenizer(self) -> Path:
        """The demo's tokenizer folder with a chat template writing BOS once (test_frontend_engine's `healthy`)."""
        def build(out: Path) -> Path:
            import transformers

            from llmdoctor.faults import frontend as ff

            demo = model_path()
            transformers.AutoTokenizer.from_pretrained(str(demo.parent), gguf_file=demo.name).save_pretrained(out)
            ff.with_chat_template(out, ff.chat_template(bos_times=1))
            return out

        return self._once("demo-tokenizer", build)

    def mapping_llama(self) -> tuple[Path, Path]:
        """test_check_mapping's quantized tiny llama: (llama.gguf, hf dir); its f32.gguf beside."""
        def build(out: Path):
            import gguf
            from test_check_mapping import LLAMA_TYPES, _tiny_llama

            from llmdoctor.faults.mapping import _rewrite

            _tiny_llama(out, vocab=96, hidden=64, ffn=96, std=1 / 8)

            def quantize(name, data, qt):
                t = LLAMA_TYPES.get(name.split(".")[-2])
                yield (name, data, qt) if t is None else (name, gguf.quants.quantize(data, t), t)

            return _rewrite(out / "f32.gguf", out / "llama.gguf", quantize), out / "hf"

        return self._once("mapping-llama", build)

    def demo_config(self) -> Path:
        def build(out: Path) -> Path:
            from llmdoctor.checks.layout import mapping
            from llmdoctor.gguf import open_gguf
            from llmdoctor.reference.config import from_gguf

            with open_gguf(model_path()) as g:
                (out / "config.json").write_text(json.dumps(mapping.hf_config(from_gguf(g), g)))
            return out / "config.json"

        return self._once("demo-config", build)


# ---- table 1: diagnose ----------------------------------------------------------------------------------------

@dataclass
class Case:
    name: str
    kind: str
    model: str
    expect: Expect
    inputs: Callable[[Fixtures, Path], dg.Inputs]  # (fixtures, scratch folder) -> the diagnosis's inputs
    patch: Callable[[], Any] = field(default=contextlib.nullcontext)  # a context in which the engine is faulty


def engine_words(inputs: dg.Inputs) -> tuple[str, str]:
    if inputs.engine is None:
        return "none (the file alone)", "-"
    if inputs.engine == "llama.cpp":
        return "llama.cpp", "float32, Q8 act., F16 KV"
    return inputs.engine, inputs.engine_dtype or "float32"


def run_case(case: Case, fx: Fixtures, tmp: Path) -> dict:
    inputs = case.inputs(fx, tmp)
    engine, dtype = engine_words(inputs)
    with case.patch():
        res = dg.run(inputs)
    return {"engine": engine, "dtype": dtype, **judge(res, case.expect)}


def demo_inputs(name: str) -> Callable[[Fixtures, Path], dg.Inputs]:
    def inputs(fx: Fixtures, tmp: Path) -> dg.Inputs:
        from llmdoctor.faults import demo

        i = dg.Inputs(gguf=model_path(), engine="llama.cpp", threads=2)  # the CLI's demo deployment
        demo.apply(name, i, tmp)
        return i

    return inputs


def decode_inputs(plant: str, engine: str, tiny: bool = False) -> Callable[[Fixtures, Path], dg.Inputs]:
    """test_decode_path's 14-token prompt and 8 generated tokens on the demo; test_decode_choices' ids and 4
    tokens on the tiny DeepSeek-V3 checkpoint."""
    def inputs(fx: Fixtures, tmp: Path) -> dg.Inputs:
        build = faults.get(plant).build
        if tiny:
            from test_decode_choices import N, PROMPT_IDS

            return dg.Inputs(hf=fx.hf("deepseek")[0], engine=engine, token_ids=PROMPT_IDS, generate=N, threads=2,
                             engine_plant=build)
        from test_decode_path import N, PROMPT

        return dg.Inputs(gguf=model_path(), engine=engine, prompt=PROMPT, generate=N, threads=2, engine_plant=build)

    return inputs


def scaled_checkpoint(kind: str, tensors) -> Callable[[Fixtures, Path], dg.Inputs]:
    def inputs(fx: Fixtures, tmp: Path) -> dg.Inputs:
        from test_reference_hf import IDS

        ckpt = fx.hf(kind)[0]
        bad = faults.get("checkpoint-scaled-tensor").build(ckpt, tmp / "bad", tensors, 1.5)
        return dg.Inputs(hf=ckpt, engine_hf=bad, engine="transformers", token_ids=IDS, threads=2)

    return inputs


def engine_copy(engine: str, names, scale: float, glm: bool = False) -> Callable[[Fixtures, Path], dg.Inputs]:
    """test_moe_routing's corrupted engine copy of the tiny DeepSeek-V3 (or llama.cpp-runnable GLM-DSA) file."""
    def inputs(fx: Fixtures, tmp: Path) -> dg.Inputs:
        import test_moe_routing as t

        gguf = (fx.mla("glm", **t.GLM_RUNNABLE) if glm else fx.mla("deepseek")).gguf_path
        bad = t.engine_copy(gguf, tmp / "bad.gguf", names, scale)
        return dg.Inputs(gguf=gguf, engine=engine, engine_gguf=bad, token_ids=t.IDS, threads=2)

    return inputs


def softmax_gating(fx: Fixtures, tmp: Path) -> dg.Inputs:
    """test_softmax_gating_instead_of_sigmoid_is_caught: the engine's copy says softmax gating."""
    from test_moe_routing import IDS

    from llmdoctor.gguf import open_gguf

    gguf, bad = fx.mla("deepseek").gguf_path, tmp / "softmax.gguf"
    shutil.copyfile(gguf, bad)
    with open_gguf(gguf) as g:
        key = "deepseek2.expert_gating_func"
        at = g.fields[key].offset + 8 + len(key) + 4  # key length, key, value type, value
    with open(bad, "r+b") as fh:
        fh.seek(at)
        fh.write(struct.pack("<I", 1))  # SOFTMAX
    return dg.Inputs(gguf=gguf, engine="llama.cpp", engine_gguf=bad, token_ids=IDS, threads=2)


@contextlib.contextmanager
def hf_build_edit(edit: Callable[[Any, Any], None]):
    """The transformers engine's loader, with `edit(model, cfg)` applied to each model it builds."""
    from llmdoctor.subjects.engines import transformers as hf_engine

    real = hf_engine.build

    def faulty(*args, **kw):
        model, cfg = real(*args, **kw)
        edit(model, cfg)
        return model, cfg

    hf_engine.build = faulty
    try:
        yield
    finally:
        hf_engine.build = real


def q_proj_in_gguf_layout(model, cfg) -> None:
    import torch

    from llmdoctor.gguf.layout import rope_permute

    q = model.model.layers[0].self_attn.q_proj.weight
    with torch.no_grad():
        q.copy_(rope_permute(q.detach().clone(), cfg.n_head))


def attention_scaled(model, cfg) -> None:
    model.model.layers[1].self_attn.register_forward_hook(lambda m, i, o: (o[0] * 1.5, *o[1:]))


def diagnose_cases() -> list[Case]:
    from llmdoctor.faults.demo import all_demo_faults

    cases = [Case(f.name, "demo", "demo", Expect(f.expect.check, f.expect.says, f.expect.layer, f.expect.swap),
                  demo_inputs(f.name)) for f in all_demo_faults()]
    decode_says = "decode path: first wrong at generated step"
    cases += [
        Case("decode-kv-overwritten", "decode", "demo", Expect("decode-path", decode_says + " 2", "any", top=False),
             decode_inputs("decode-kv-overwritten", "llama.cpp")),
        Case("decode-rope-previous-position", "decode", "demo",
             Expect("decode-path", decode_says, "any", top=False,
                    note="found in the decode steps' activations; their distributions stay within the noise"),
             decode_inputs("decode-rope-previous-position", "llama.cpp")),
        Case("decode-cache-position", "decode", "demo", Expect("decode-path", decode_says, "any", top=False),
             decode_inputs("decode-cache-position", "transformers")),
        Case("decode-cache-position", "decode", "tiny DeepSeek-V3", Expect("decode-path", decode_says, top=False),
             decode_inputs("decode-cache-position", "transformers", tiny=True)),
        Case("head-count-kv-3", "file", "demo", Expect("metadata", "head_count_kv = 3 does not divide head_count = 4"),
             lambda fx, tmp: dg.Inputs(gguf=faults.get("head-count-kv-3").build(model_path(), tmp), threads=2)),
        Case("checkpoint-scaled-tensor", "engine", "tiny llama", Expect("layer-localization", layer=0, top=False),
             scaled_checkpoint("llama", {"model.layers.0.mlp.down_proj.weight"})),
        Case("checkpoint-scaled-tensor", "engine", "tiny DeepSeek-V3",
             Expect("layer-localization", layer=1, top=False),
             scaled_checkpoint("deepseek", lambda n: n.startswith("model.layers.1.mlp.experts.")
                               and n.endswith("down_proj.weight"))),
        Case("router-negated", "test plant", "tiny DeepSeek-V3", Expect("moe-routing", layer=1, top=False),
             engine_copy("transformers", {"blk.1.ffn_gate_inp.weight"}, -1.0)),
        Case("experts-scaled", "test plant", "tiny DeepSeek-V3", Expect("layer-localization", layer=1, top=False),
             engine_copy("transformers", {"blk.1.ffn_down_exps.weight"}, 3.0)),
        Case("correction-bias-zeroed", "test plant", "tiny DeepSeek-V3", Expect("moe-routing", layer=1, top=False),
             engine_copy("llama.cpp", lambda n: n.endswith("exp_probs_b.bias"), 0.0)),
        Case("softmax-gating", "test plant", "tiny DeepSeek-V3",
             Expect("moe-routing", "routing differs", 1, top=False), softmax_gating),
        Case("indexer-negated", "test plant", "tiny GLM-5 DSA",
             Expect("dsa-selection", "sparse-attention indexer selects other keys from layer 0", 0, top=False),
             engine_copy("llama.cpp", {"blk.0.indexer.attn_k.weight"}, -1.0, glm=True)),
        Case("q-proj-in-gguf-layout", "test plant", "tiny llama",
             Expect("layer-localization", layer=0, op="the engine holds model.layers.0.self_attn.q_proj.weight",
                    top=False),
             lambda fx, tmp: dg.Inputs(gguf=fx.hf("llama")[1], engine="transformers", token_ids=list(range(3, 19)),
                                       threads=2),
             lambda: hf_build_edit(q_proj_in_gguf_layout)),
        Case("attention-out-scaled", "test plant", "tiny DeepSeek-V3", Expect("layer-localization", layer=1, top=False),
             lambda fx, tmp: dg.Inputs(gguf=fx.mla("deepseek").gguf_path, engine="transformers",
                                       token_ids=__import__("test_moe_routing").IDS, threads=2),
             lambda: hf_build_edit(attention_scaled)),
    ]
    return cases


# ---- table 2: the other commands ------------------------------------------------------------------------------

# The reference's own faults (faults/reference*.py), judged as test_rope_cause.py judges them: the reference runs with
# the fault, a healthy float32 reference stands in for the engine; each must diverge at its point, and read as RoPE
# (a cause naming the variant) exactly where it is one: name -> (model, first divergent point, a RoPE cause).
REFERENCE_CASES = {"reference-rope-pairing": ("llama", "Qcur-0", True),
                   "reference-qk-rows-unpermuted": ("llama", "Qcur-0", False),
                   "reference-missing-norm-offset": ("llama", "attn_norm-0", False),
                   "reference-wrong-rope-base": ("deepseek", "q_pe-0", True),
                   # MLA absorbs k_b into q first: Qcur is q_nope through k_b (its latent channels), then q_pe
                   "reference-mla-kv-b-swapped": ("deepseek", "Qcur-0", False)}


def other_row(f, command: str, model: str, expected: str, result: str, seconds: float | None = None,
              detail: str = "") -> dict:
    return {"fault": f.name, "kind": f.kind, "command": command, "model": model, "expected": expected,
            "result": result, "seconds": None if seconds is None else round(seconds, 1), "detail": detail[:300]}


def hostile(fs, tmp: Path) -> list[dict]:
    from llmdoctor.gguf import GGUFError, open_gguf

    rows = []
    for f in fs:
        t0 = time.perf_counter()
        built = f.build()
        d = tmp / f.name
        d.mkdir()
        if f.kind == "hostile-split":
            for name, data in built.files.items():
                (d / name).write_bytes(data)
            path = d / built.open
        else:
            path = d / f"{f.name}.gguf"
            path.write_bytes(built)
        try:
            with open_gguf(path):
                pass
            result, msg = "not found (it opened)", ""
        except GGUFError as e:
            msg = str(e)
            result = "found" if f.expect in msg else "not found (another error)"
        rows.append(other_row(f, "inspect", "hostile file", f.expect, result, time.perf_counter() - t0,
                              msg.removeprefix(str(d) + "/")))
    return rows


def dequant_kernels(fs, tmp: Path) -> list[dict]:
    from llmdoctor.checks.kernels import dequant
    from llmdoctor.faults.kernels import DEMO_TARGET
    from llmdoctor.subjects.kernels import IsolatedKernel

    rows = []
    for f in fs:
        t0 = time.perf_counter()
        res = dequant.run(model_path(), IsolatedKernel, kernel=f.build(), only=DEMO_TARGET[f.name],
                          timeout=2 if f.name == "hangs" else dequant.DEFAULT_TIMEOUT)
        failed = [x for x in res.findings if x.status == "fail"]
        if f.expect == "reduced-precision arithmetic":  # a correct kernel: it must pass, as reduced precision
            ok = not failed and any(x.reason == f.expect for x in res.findings)
            expected, detail = "passes: reduced-precision arithmetic (a correct kernel)", ""
        else:
            ok, expected = any(f.expect in x.reason for x in failed), f"fails: {f.expect}"
            detail = failed[0].reason if failed else ""
        rows.append(other_row(f, f"check dequant --only {DEMO_TARGET[f.name]}", "demo", expected,
                              "found" if ok else "not found", time.perf_counter() - t0, detail))
    return rows


def attention_kernels(fs, tmp: Path) -> list[dict]:
    """One `check attention` run of the planted prefill/decode kernels (test_check_attention's fault_run), and
    the float16-only one on its own dtypes and cases."""
    from test_check_attention import FAULT_CASES, GLM

    from llmdoctor.checks.kernels import attention as ca
    from llmdoctor.subjects.attention import IsolatedAttention

    rows = []
    main = [f for f in fs if f.name != "attn-fp16-as-bf16"]
    if main:
        t0 = time.perf_counter()
        built = {f.name: f.build() for f in main}
        res = ca.run(GLM, [(b["impl"], b["contract"]) for b in built.values()], IsolatedAttention,
                     dtypes=("bfloat16",), only=FAULT_CASES)
        each = (time.perf_counter() - t0) / len(main)
        for f in main:
            failed = [x for x in res.findings if x.subject.startswith(built[f.name]["impl"]) and x.status == "fail"]
            said = " | ".join(x.explanation + " " + x.reason for x in failed)
            rows.append(other_row(f, "check attention (glm-5 shape, bfloat16)", "glm-5 attention", f.expect,
                                  "found" if failed and f.expect in said else "not found", each, said))
    for f in (f for f in fs if f.name == "attn-fp16-as-bf16"):
        t0 = time.perf_counter()
        b = f.build()
        res = ca.run(GLM, [(b["impl"], b["contract"])], IsolatedAttention, dtypes=("float32", "bfloat16", "float16"),
                     only={"batch1", "ragged"})
        dtypes = {x.metrics["dtype"] for x in res.findings if x.status == "fail"}
        named = any(f.expect in p for p in res.patterns[f"{b['impl']} ({b['contract']})"])
        rows.append(other_row(f, "check attention (3 dtypes)", "glm-5 attention", f"fails in float16 only: {f.expect}",
                              "found" if dtypes == {"float16"} and named else "not found", time.perf_counter() - t0,
                              f"failing dtypes {sorted(dtypes)}"))
    return rows


# the tensor each file corruption plants into (its test's), and what forensics must say of it
FORENSICS = {"scale-noise": ({"tensor": "blk.7.attn_q.weight"}, "blk.7.attn_q.weight"),
             "scale-inf": ({"tensor": "blk.7.attn_output.weight", "block": 3}, "blk.7.attn_output.weight"),
             "q4k-d-dmin-swap": ({}, None),  # the first Q4_K tensor in the blocks
             "subblock-scales": ({}, "blk.1.ffn_down.weight"),
             "attn-block-scales": ({"layers": "blk.7.attn_output"}, "blk.7.attn_output.weight"),
             "rows-shuffled": ({"tensor": "blk.7.attn_output.weight"}, "")}  # "": unseen by design


def forensics(fs, tmp: Path) -> list[dict]:
    from gguf import GGMLQuantizationType as QT

    from llmdoctor.checks.file import forensics as F
    from llmdoctor.gguf import open_gguf

    rows = []
    for f in fs:
        kw, target = FORENSICS[f.name]
        d = tmp / f.name
        d.mkdir()
        t0 = time.perf_counter()
        bad = f.build(model_path(), d, **kw)
        if target is None:
            with open_gguf(bad) as g:
                target = next(t.name for t in g.tensors if t.type == QT.Q4_K and t.name.startswith("blk."))
        failed = sorted({x.target for x in F.analyze(bad)[0] if x.status == "fail"})
        if target:
            expected, ok = f"fails: {target}", failed == [target]
        else:
            expected, ok = "no finding (a permutation keeps every statistic)", not failed
        note = "; its registry expectation (the probe's reference-mismatch) is judged in the probe's rows" \
            if f.name == "attn-block-scales" else ""
        result = ("found" if ok else "not found") if target else ("unseen, as expected" if ok else "seen")
        rows.append(other_row(f, "check forensics", "demo", expected, result, time.perf_counter() - t0,
                              f"failing: {failed}{note}"))
        shutil.rmtree(d)  # a demo copy each
    return rows


def probe_faults(fs, tmp: Path) -> list[dict]:
    """`probe` against a live llama.cpp server on the demo (llama_cpp.server on 127.0.0.1, stopped by its PID), each
    fault as test_probe.py plants it: a proxy in front of the server, with the probe steps that can see it and the
    client's options; a file fault served from its own corrupted copy. Found: the fault's symptom among the probe's,
    or for a chat refused for want of a template the chat step's skip saying so (not a server error)."""
    from test_probe import _PROXY, llama_server, probe_url

    steps = {**_PROXY, "swap-responses": (["batch"], {}, {})}
    front_end = {"endpoint-tokenize-no-bos", "endpoint-chat-no-template"}

    def judged(f, url: str) -> tuple[bool, str]:
        if f.kind == "file":
            rep = probe_url(url, gguf=model_path(), steps=["positions", "reference"])
        elif f.name in front_end:
            rep = probe_url(url, gguf=model_path(), steps=["front_end"])
        else:
            run, client, _ = steps[f.name]
            rep = probe_url(url, steps=run, concurrency=3, **client)
        if f.name == "endpoint-chat-no-template":
            chat = next(x for x in rep.findings if x.target == "chat")
            return (chat.status == "skip" and chat.reason.startswith(f.expect)
                    and "server-errors" not in rep.symptoms), f"chat: {chat.status} {chat.reason[:80]}"
        return f.expect in rep.symptoms, f"{rep.verdict}: {sorted(rep.symptoms)}"

    rows = []
    with llama_server(model_path(), tmp / "server.log") as url:
        for f in fs:
            t0 = time.perf_counter()
            if f.kind == "file":
                with llama_server(f.build(model_path(), tmp), tmp / f"{f.name}.log") as bad:
                    ok, said = judged(f, bad)
            else:
                with f.build(url, **steps.get(f.name, (None, {}, {}))[2]) as proxy:
                    ok, said = judged(f, proxy.url)
            rows.append(other_row(f, "probe", "demo", f.expect, "found" if ok else "not found",
                                  time.perf_counter() - t0, said))
    return rows


def reference_faults(fs, fx: Fixtures) -> list[dict]:
    """Each fault of the reference itself against a healthy run (test_rope_cause.py `_localize`): found where it
    first diverges at its point, its error pattern naming RoPE exactly where it is a RoPE fault."""
    from test_rope_cause import _localize

    rows = []
    for f in fs:
        model, at, rope = REFERENCE_CASES[f.name]
        t0 = time.perf_counter()
        path = fx.hf("llama")[1] if model == "llama" else fx.mla("deepseek").gguf_path
        point, pattern = _localize(path, f.name)
        named = f"{point.point}-{point.layer}"
        ok = named == at and pattern.cause.startswith("RoPE applied wrongly") == rope
        rows.append(other_row(f, "reference comparison", f"tiny {model}", f"{at}, {'a' if rope else 'no'} RoPE cause",
                              "found" if ok else "not found", time.perf_counter() - t0,
                              f"{named}: {pattern.cause or pattern.words}"[:200]))
    return rows


def mapping_faults(fs, tmp: Path, fx: Fixtures) -> list[dict]:
    """mapping.run on test_check_mapping's pairs (`_pair`); the test's NAMED sentence must be said too."""
    from test_check_mapping import NAMED

    from llmdoctor.checks.layout import mapping

    def pair(name: str) -> tuple[Path, Path, str]:
        if name in ("mapping-swap-layers", "mapping-k-wrong-heads"):
            gguf, hf = fx.mapping_llama()
            return (gguf if name == "mapping-swap-layers" else gguf.with_name("f32.gguf")), hf, "tiny llama"
        if name in ("mapping-kb-not-transposed", "mapping-experts-order"):
            m = fx.mla("deepseek")
            return m.gguf_path, m.gguf_path.parent / "hf-deepseek", "tiny DeepSeek-V3"
        if name.startswith("mapping-indexer"):
            m = fx.mla("glm")
            return m.gguf_path, m.gguf_path.parent / "hf-glm", "tiny GLM-5 DSA"
        return model_path(), fx.demo_config(), "demo"

    rows = []
    for f in fs:
        gguf, hf, model = pair(f.name)
        d = tmp / f.name
        d.mkdir()
        t0 = time.perf_counter()
        bad, bad_hf = f.build(gguf, hf, d)
        msgs = [x.explanation for x in mapping.run(bad, bad_hf).findings if x.status == "fail"]
        ok = any(f.expect in m for m in msgs) and any(NAMED[f.name] in m for m in msgs)
        rows.append(other_row(f, "check mapping", model, NAMED[f.name], "found" if ok else "not found",
                              time.perf_counter() - t0, msgs[0] if msgs else ""))
        shutil.rmtree(d)
    return rows


# test_frontend_engine's engine for each tokenizer-folder fault
FRONTEND_ENGINE = {"tokenizer-no-bos": "transformers", "tokenizer-lost-merges": "llama.cpp",
                   "tokenizer-other-model": "llama.cpp", "chat-template-double-bos": "transformers"}


def frontend(fs, tmp: Path, fx: Fixtures) -> list[dict]:
    from llmdoctor.checks.frontend import engine as fe
    from llmdoctor.subjects.engines import create
    from llmdoctor.subjects.engines.base import Deployment

    rows = []
    ref = fe.ReferenceFrontEnd(model_path())
    for f in fs:
        d = tmp / f.name
        d.mkdir()
        t0 = time.perf_counter()
        folder = f.build(fx.demo_tokenizer(), d)
        e = create(FRONTEND_ENGINE[f.name], Deployment(model=model_path(), tokenizer=folder))
        found = fe.finding(e, ref, fe.compare(e, ref, "The capital of France is"))
        ok = found.status == "fail" and f.expect in found.explanation
        rows.append(other_row(f, f"front-end check ({FRONTEND_ENGINE[f.name]})", "demo", f.expect,
                              "found" if ok else "not found", time.perf_counter() - t0, found.explanation))
    return rows


# test_sharding's plans: (tensor-parallel size, rules) and the point each fault must first diverge at
SHARDING = {"sharding-heads-permuted": (2, "vllm", "attn_out-0"), "sharding-kv-b-latent-axis": (2, "vllm", "attn_out-0"),
            "sharding-vocab-offset": (2, "vllm", "embedding"), "sharding-missing-all-reduce": (2, "vllm", "attn_out-0"),
            "sharding-experts-wrong-rank": (4, "vllm-ep", "ffn_out-1")}


def sharding_faults(fs, tmp: Path, fx: Fixtures) -> list[dict]:
    from llmdoctor.checks.file import sharding
    from llmdoctor.faults.sharding import plant

    rows = []
    for t, rules in sorted({SHARDING[f.name][:2] for f in fs}):
        mine = [f for f in fs if SHARDING[f.name][:2] == (t, rules)]
        t0 = time.perf_counter()
        res = sharding.run(fx.mla("deepseek").gguf_path, t, rules=rules, n_tokens=5, faults=[f.name for f in mine],
                           plant=plant)
        each = (time.perf_counter() - t0) / len(mine)
        first = {p.plan: p.first for p in res.plans}
        for f in mine:
            got = first.get(f"fault:{f.name}") or {}
            point = SHARDING[f.name][2]
            ok = got.get("point") == point and f.expect in (got.get("explained_by") or "")
            rows.append(other_row(f, f"check sharding --tp {t} ({rules})", "tiny DeepSeek-V3",
                                  f"{point}: {f.expect}", "found" if ok else "not found", each,
                                  f"first divergence {got.get('point')}: {got.get('explained_by')}"))
    return rows


# ---- running and printing ------------------------------------------------------------------------------------

def other_groups(fs: list) -> list[tuple[str, list, Callable]]:
    """(group, its faults, runner(faults, tmp, fixtures)) for every registry fault outside table 1."""
    dequant = {f.name for f in faults.all_faults("kernel") if not f.name.startswith("attn-")}
    by = {
        "hostile files": (lambda f: f.kind in ("hostile-file", "hostile-split"), lambda fs, tmp, fx: hostile(fs, tmp)),
        "dequant kernels": (lambda f: f.name in dequant, lambda fs, tmp, fx: dequant_kernels(fs, tmp)),
        "attention kernels": (lambda f: f.kind == "kernel" and f.name.startswith("attn-"),
                              lambda fs, tmp, fx: attention_kernels(fs, tmp)),
        "file corruptions": (lambda f: f.name in FORENSICS, lambda fs, tmp, fx: forensics(fs, tmp)),
        "name maps": (lambda f: f.name.startswith("mapping-"), mapping_faults),
        "front end": (lambda f: f.kind == "frontend", frontend),
        "sharding": (lambda f: f.name in SHARDING, sharding_faults),
        # a file fault served to the probe too: rope-base, and attn-block-scales, whose registry expectation is the
        # probe's (forensics judges the same corruption above)
        "endpoints": (lambda f: f.kind == "endpoint" or f.name in ("rope-base", "attn-block-scales"),
                      lambda fs, tmp, fx: probe_faults(fs, tmp)),
        "reference": (lambda f: f.name in REFERENCE_CASES, lambda fs, tmp, fx: reference_faults(fs, fx)),
    }
    return [(g, [f for f in fs if pick(f)], run) for g, (pick, run) in by.items()]


def md_table(head: list[str], rows: list[list[Any]]) -> str:
    cell = lambda v: "" if v is None else str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def print_tables(diag: list[dict], other: list[dict]) -> None:
    if diag:
        print(md_table(["fault", "kind", "model", "engine", "dtype", "expected (its test)", "named (top suspect)",
                        "found", "margin (judged finding)", "other failing ratios", "s"],
                       [[r["fault"], r["kind"], r["model"], r.get("engine"), r.get("dtype"), r["expected"],
                         r.get("named"), r["found"], r.get("margin"), r.get("other_ratios"), r["seconds"]]
                        for r in diag]))
        print()
    if other:
        print(md_table(["fault", "kind", "command", "model", "expected", "result", "s"],
                       [[r["fault"], r["kind"], r["command"], r["model"], r["expected"], r["result"], r["seconds"]]
                        for r in other]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="fault names, comma-separated (both tables)")
    ap.add_argument("--list", action="store_true", help="list the faults and the command that judges each")
    ap.add_argument("--json-out")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    keep = lambda name: only is None or name in only  # noqa: E731
    cases = [c for c in diagnose_cases() if keep(c.name)]
    covered = {c.name for c in diagnose_cases()}
    groups = [(g, [f for f in fs if keep(f.name) and f.name not in covered], run)
              for g, fs, run in other_groups([f for f in faults.all_faults() if f.kind != "demo"])]
    grouped = covered | {f.name for _, fs, _ in groups for f in fs} | {f.name for f in faults.all_faults("demo")}
    loose = [f for f in faults.all_faults() if f.name not in grouped and keep(f.name)]
    if a.list:
        for c in cases:
            print(f"{c.name}\tdiagnose\t{c.model}\t{c.expect.words()}")
        for g, fs, _ in groups:
            for f in fs:
                print(f"{f.name}\t{g}\t{f.kind}\t{f.expect}")
        for f in loose:
            print(f"{f.name}\tno runner\t{f.kind}\t{f.expect}")
        return
    t_all = time.perf_counter()
    diag, other = [], []
    with tempfile.TemporaryDirectory(prefix="bench-power-") as work:
        fx = Fixtures(Path(work))
        for i, c in enumerate(cases):
            tmp = Path(work) / f"case-{i}"
            tmp.mkdir()
            row = {"fault": c.name, "kind": c.kind, "model": c.model, "expected": c.expect.words(),
                   "expect_note": c.expect.note}
            t0 = time.perf_counter()
            try:
                row.update(run_case(c, fx, tmp))
            except Exception as e:  # a crash is a row, not the end of the bench
                row.update(found="error", named=f"{type(e).__name__}: {e}"[:300])
            row["seconds"] = round(time.perf_counter() - t0, 1)
            shutil.rmtree(tmp, ignore_errors=True)
            diag.append(row)
            print(json.dumps(row), flush=True)
        for g, fs, run in groups:
            if not fs:
                continue
            tmp = Path(work) / g.replace(" ", "-")
            tmp.mkdir()
            t0 = time.perf_counter()
            try:
                rows = run(fs, tmp, fx)
            except Exception as e:
                rows = [other_row(f, g, "-", f.expect, f"error: {type(e).__name__}: {e}"[:300],
                                  time.perf_counter() - t0) for f in fs]
            shutil.rmtree(tmp, ignore_errors=True)
            other += rows
            for r in rows:
                print(json.dumps(r), flush=True)
        other += [other_row(f, "-", "-", f.expect, "not run here: no runner in this bench") for f in loose]
    wall = time.perf_counter() - t_all
    print()
    print_tables(diag, other)
    found = sum(r["found"] == "yes" for r in diag)
    as_expected = sum(r["result"] in ("found", "unseen, as expected") for r in other)
    ran = sum(not r["result"].startswith("not run") for r in other)
    print(f"\ndiagnose: {found} of {len(diag)} found; other commands: {as_expected} of {ran} run as expected "
          f"({len(other)} rows); wall {wall:.0f} s")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps({"diagnose": diag, "other": other, "wall_s": round(wall, 1)}, indent=1))


if __name__ == "__main__":
    main()
