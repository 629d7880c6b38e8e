"""check attention: reference wrappers, planted faulty kernels caught and named, correct subjects pass,
unavailable adapters skipped, CLI conventions. CPU only, tiny head counts (the cases' structure is what
is tested, not the width)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import pytest
import torch

from llmdoctor import faults
from llmdoctor.checks.kernels import attention as ca
from llmdoctor.checks.kernels import attention_budgets as budgets
from llmdoctor.checks.kernels import attention_reference as case_reference
from llmdoctor.checks.kernels import attention_inputs as inputs
from llmdoctor.checks.kernels import attention_shapes as shapes
from llmdoctor.checks.kernels import attention_suite as suite
from llmdoctor.checks.kernels import attention_verdicts as verdicts
from llmdoctor.checks.kernels.attention_consistency import consistency
from llmdoctor.errors import InputError
from llmdoctor.outcomes import AttentionReply, LoadFailed
from llmdoctor.reference import attention as attn
from llmdoctor.reference import attention_cases as ref
from llmdoctor.reference import mla as mla_ref
from llmdoctor.subjects import attention as subj
from llmdoctor.subjects.attention import IsolatedAttention

pytestmark = pytest.mark.slow

GLM = dataclasses.replace(shapes.PRESETS["glm-5"], n_head=2, n_head_kv=2)


def _by(findings, subject):
    return [f for f in findings if f.subject.startswith(subject)]


# ----------------------------------------------------------------------------- reference wrappers

def test_varlen_matches_per_sequence_attention_and_empty_rows_are_zero():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 4, 8, generator=g, dtype=torch.float64) for n in (6, 14, 14))
    cu_q, cu_k = torch.tensor([0, 2, 3, 6]), torch.tensor([0, 9, 9, 14])  # the middle sequence has kv_len 0
    out, lse = ref.varlen(q, k, v, cu_q, cu_k, scale=0.3, causal=True)
    torch.testing.assert_close(out[0:2], attn.attention(q[0:2], k[0:9], v[0:9], scale=0.3))
    torch.testing.assert_close(out[3:6], attn.attention(q[3:6], k[9:14], v[9:14], scale=0.3))
    assert (out[2] == 0).all() and torch.isinf(lse[:, 2]).all() and (lse[:, 2] < 0).all()


def test_chunks_merged_by_lse_equal_the_unchunked_reference():
    case = suite.Case("c", "prefill", ((4, 20), (3, 3), (6, 45)), chunk=16)
    x = inputs.make_inputs(GLM, case, 0)
    whole, whole_lse = ref.varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], scale=GLM.scale, causal=True)
    calls = case_reference.chunk_calls(case, x)
    assert any(int(cu[b + 1] - cu[b]) == 0 for _, _, cu, _ in calls for b in range(3))  # a kv_len-0 chunk
    out, lse = case_reference.reference(GLM, case, x)
    torch.testing.assert_close(out, whole)
    torch.testing.assert_close(lse, whole_lse)


def test_paged_latent_attention_equals_naive_mla_and_ignores_nan_pages():
    m = GLM.mla
    case = suite.Case("d", "mla-decode", ((1, 21), (1, 40)))
    x = inputs.make_inputs(GLM, case, 1)
    assert torch.isnan(x["kv_cache"]).any()  # unused pages and page tails are NaN
    g = torch.Generator().manual_seed(2)
    k_b = torch.randn(2, m.kv_lora_rank, m.qk_nope, generator=g, dtype=torch.float64) / 20
    v_b = torch.randn(2, m.v_dim, m.kv_lora_rank, generator=g, dtype=torch.float64) / 20
    q_nope = torch.randn(2, 2, m.qk_nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(2, 2, m.qk_rope, generator=g, dtype=torch.float64)
    x["q"] = mla_ref.absorb_q(q_nope, q_pe, k_b)
    out, _ = ref.mla_paged(x["q"], x["kv_cache"], x["block_table"], x["cu_q"], x["seq_lens"], scale=GLM.scale,
                           kv_lora_rank=m.kv_lora_rank)
    for b, n in enumerate((21, 40)):
        rows = ref.gather_pages(x["kv_cache"], x["block_table"][b], n)
        assert not torch.isnan(rows).any()
        allowed = torch.ones(1, n, dtype=torch.bool)
        naive = mla_ref.mla_naive(q_nope[b:b + 1], q_pe[b:b + 1], rows[:, :m.kv_lora_rank], rows[:, m.kv_lora_rank:],
                                  k_b, v_b, allowed, scale=GLM.scale)
        torch.testing.assert_close(torch.einsum("hr,hvr->hv", out[b], v_b), naive[0])


def test_selection_ignores_minus_one_counts_duplicates_once_and_stays_causal():
    topk = torch.tensor([[3, 3, -1, 0, 5], [1, -1, -1, -1, 4]])
    sel = ref.selection(topk, 2, 5)  # the 2 queries sit at positions 3 and 4
    assert sel.tolist() == [[True, False, False, True, False], [False, True, False, False, True]]


def test_noise_floor_grows_as_precision_shrinks():
    case = suite.cases(GLM)[0]
    f32, bf16 = budgets.noise_floor(GLM, case, torch.float32), budgets.noise_floor(GLM, case, torch.bfloat16)
    assert 0 < f32.out_max < 1e-5 < bf16.out_max < 0.1


# ----------------------------------------------------------------------------- planted faults

FAULT_CASES = {"ragged", "context-chunk-kv0", "chunked", "long-keys", "mla-decode-ragged", "mla-decode-b1"}


@pytest.fixture(scope="module")
def fault_run():
    planted = [f for f in faults.all_faults("kernel") if f.name.startswith("attn-") and f.name != "attn-fp16-as-bf16"]
    subjects = [(b["impl"], b["contract"]) for b in (f.build() for f in planted)]
    subjects += [("llmdoctor.faults.attention:prefill", "prefill"), ("llmdoctor.faults.attention:mla_decode", "mla-decode")]
    return planted, ca.run(GLM, subjects, IsolatedAttention, dtypes=("bfloat16",), only=FAULT_CASES)


def test_every_planted_attention_fault_is_caught_and_named(fault_run):
    planted, res = fault_run
    assert len(planted) == 9
    for f in planted:
        mine = _by(res.findings, f.build()["impl"])
        failed = [x for x in mine if x.status == "fail"]
        assert failed, f"{f.name} not caught"
        said = " | ".join(x.explanation + " " + x.reason for x in failed)
        assert f.expect in said, f"{f.name}: {said}"


def test_correct_kernels_pass_every_case(fault_run):
    _, res = fault_run
    for spec in ("llmdoctor.faults.attention:prefill ", "llmdoctor.faults.attention:mla_decode "):
        mine = _by(res.findings, spec)
        assert mine and all(f.status == "pass" for f in mine), [(f.target, f.reason) for f in mine]


def test_page_tail_fault_still_fails_with_finite_rows_past_seq_len(fault_run):
    """The follow-up with finite unused rows does not excuse a kernel that attends to them."""
    _, res = fault_run
    failed = [x for x in _by(res.findings, "llmdoctor.faults.attention:mla_decode_page_tail") if x.status == "fail"]
    assert failed and all("with finite rows past seq_len it still fails" in x.explanation for x in failed), failed


def test_a_kernel_weighing_unused_rows_by_zero_passes_with_the_nan_as_information():
    """flash-attn 3's MLA decode on the H200 (bench/h200_fa_mla_probe.py): NaN in a page's unused rows
    reaches its output (0 x NaN), its math is right. Planted as mla_decode_zero_weight_tail: judged
    again on finite unused rows, it passes, and the NaN is reported, not judged."""
    spec = "llmdoctor.faults.attention:mla_decode_zero_weight_tail"
    only = {"mla-decode-ragged", "mla-decode-b1", "mla-decode-long"}
    res = ca.run(GLM, [(spec, "mla-decode")], IsolatedAttention, dtypes=("bfloat16",), only=only)
    mine = {f.target: f for f in res.findings if f.target.split("/")[0] in only}
    assert len(mine) == 3 and all(f.status == "pass" for f in mine.values()), [(t, f.reason) for t, f in mine.items()]
    for f in mine.values():  # every case has a page tail: the NaN reached the output first
        assert f.metrics["nonfinite_with_nan_unused_rows"] > 0 and f.metrics["nonfinite"] == 0
        assert "information, not judged" in f.reason and "weighs rows past seq_len by zero" in f.reason


def test_the_unused_rows_information_is_printed_and_the_check_passes():
    from typer.testing import CliRunner

    from llmdoctor.cli import app

    r = CliRunner().invoke(app, ["check", "attention", "--impl", "llmdoctor.faults.attention:mla_decode_zero_weight_tail",
                                 "--contract", "mla-decode", "--cases", "mla-decode-b1", "--dtype", "bfloat16"],
                           env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.stdout
    assert "pass (information)" in r.stdout and "weighs rows past seq_len by zero" in r.stdout, r.stdout


def test_stale_unused_rows_fill_only_the_nan_rows_and_keep_fp8_on_its_grid():
    case = next(c for c in suite.cases(GLM) if c.name == "mla-decode-fp8")
    x = inputs.make_inputs(GLM, case, inputs.case_seed(0, case))
    x = inputs.fp8_cache(x)
    y = inputs.stale_unused_rows(x, 5)
    nan = torch.isnan(x["kv_cache"])
    assert nan.any() and torch.isfinite(y["kv_cache"]).all()
    assert torch.equal(y["kv_cache"][~nan], x["kv_cache"][~nan])
    grid = (y["kv_cache"] / x["kv_scale"]).to(inputs.FP8).to(torch.float64) * x["kv_scale"]
    assert torch.equal(grid, y["kv_cache"])  # the stale rows are fp8 values at the cache's scale
    assert not torch.equal(inputs.stale_unused_rows(x, 6)["kv_cache"], y["kv_cache"])


def test_scale_signature_names_the_dims(fault_run):
    _, res = fault_run
    f = next(x for x in _by(res.findings, "llmdoctor.faults.attention:mla_decode_scale_576") if x.status == "fail")
    assert "1/sqrt(576)" in f.explanation and f"{1 / math.sqrt(256):.6g}" in f.explanation


# ----------------------------------------------------------------------------- built-in subjects

def test_builtin_subjects_pass_and_consistency_holds_on_cpu():
    res = ca.run(GLM, [("sdpa-math", None), ("flex", None)], IsolatedAttention, dtypes=("bfloat16",))
    for s in ("sdpa-math", "flex"):
        mine = _by(res.findings, s)
        assert not [f for f in mine if f.status == "fail"], [(f.target, f.reason) for f in mine if f.status == "fail"]
        names = {f.target.split("/")[0] for f in mine if f.status == "pass"}
        assert {"prefill-row-vs-decode", "absorbed-vs-naive", "sparse-prefill-row-vs-decode", "sparse-prefill",
                "mla-decode-long", "mla-decode-fp8"} <= names
    chunked = {f.subject: f for f in res.findings if f.target == "chunked/bfloat16"}
    assert chunked["sdpa-math"].status == "skip" and "lse" in chunked["sdpa-math"].reason
    assert chunked["flex"].status == "pass"


def test_unavailable_adapters_are_skipped_with_the_reason():
    res = ca.run(GLM, [(n, None) for n in ("flash-attn", "flashinfer", "vllm", "sdpa-efficient", "sdpa-cudnn")],
                 IsolatedAttention, dtypes=("bfloat16",), only={"batch1"})
    assert len(res.findings) == 5 and all(f.status == "skip" for f in res.findings)
    why = {f.subject: f.reason for f in res.findings}
    assert "not installed" in why["flash-attn"] and "does not import vllm" in why["vllm"]  # ours has no vLLM
    assert "CUDA only" in why["sdpa-cudnn"]
    asked = subj.engine_backends(GLM.mla.kv_lora_rank + GLM.mla.qk_rope, "bfloat16", use_mla=True, use_sparse=True)
    assert "does not import vllm" in asked["skipped"]  # ours; test_engine_vllm asks vLLM


# ----------------------------------------------------------------------------- CLI

def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmdoctor.cli", "check", "attention", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_json_names_the_planted_bug_and_exits_1():
    p = _cli("--preset", "llama-3-8b", "--impl", "llmdoctor.faults.attention:prefill_top_left", "--contract", "prefill",
             "--dtype", "float16", "--cases", "ragged", "--json")
    assert p.returncode == 1, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["schema"] == "llmdoctor.check.attention/1" and out["verdict"] == "failed"
    assert out["counts"] == {"passed": 0, "failed": 1, "skipped": 0}
    assert "top-left" in out["findings"][0]["explanation"]
    assert out["env"]["torch"] and "compute_capability" in out["env"]


def test_cli_bad_input_is_one_line_and_exit_2():
    p = _cli("--impl", "llmdoctor.faults.attention:prefill", "--json")
    assert p.returncode == 2 and "--contract" in p.stderr
    assert json.loads(p.stdout)["verdict"] == "error"
    p = _cli("--preset", "nope")
    assert p.returncode == 2 and "--preset" in p.stderr and "Traceback" not in p.stderr


def test_the_check_runs_the_subject_its_caller_opens():
    """The seam (issue 33): check attention starts no subject itself; its caller hands one in (the CLI:
    IsolatedAttention). One that cannot load is a load skip; an InputError while loading is the user's."""
    class Unloadable:
        restarts = 0

        def __init__(self, spec, contract, **kw):
            self.kind = spec

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def start(self):
            raise LoadFailed(self.kind, "not loadable here")

    res = ca.run(GLM, [("ImportError", None)], Unloadable, dtypes=("float32",), only={"batch1"})
    assert [(f.target, f.status) for f in res.findings] == [("load", "skip")]
    assert res.subjects["ImportError"] == {"loaded": False, "reason": "not loadable here"}
    with pytest.raises(InputError, match="not loadable here"):
        ca.run(GLM, [("InputError", None)], Unloadable, dtypes=("float32",), only={"batch1"})


def test_consistency_catches_a_kernel_that_disagrees_with_itself():
    spec = "llmdoctor.faults.attention:prefill_top_left"
    with IsolatedAttention(spec, "prefill") as kernel:
        kernel.start()
        (f,) = consistency(kernel, GLM, torch.bfloat16, "bfloat16", spec, {"prefill"}, 0)
    assert f.target == "prefill-row-vs-decode/bfloat16" and f.status == "fail", f.reason


def test_shapes_from_an_hf_config_and_a_gguf_agree_with_the_presets(tmp_path):
    from llmdoctor.demo import model_path

    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "hidden_size": 7168, "intermediate_size": 18432, "vocab_size": 129280, "rope_theta": 10000,
           "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf, preset = shapes.load_shape(None, tmp_path / "config.json", None), shapes.PRESETS["deepseek-v3"]
    assert (hf.n_head, hf.head_dim, hf.head_dim_v, hf.mla.kv_lora_rank) == (128, 192, 128, 512)
    assert math.isclose(hf.scale, preset.scale) and hf.scale > 192 ** -0.5  # YaRN mscale^2 included
    g, gemma = shapes.load_shape(None, None, model_path()), shapes.PRESETS["gemma3-270m"]
    assert (g.n_head, g.n_head_kv, g.head_dim, g.window) == (gemma.n_head, gemma.n_head_kv, gemma.head_dim, gemma.window)


def test_a_float16_only_bug_is_named_by_the_subject_pattern():
    fault = faults.get("attn-fp16-as-bf16")
    b = fault.build()
    res = ca.run(GLM, [(b["impl"], b["contract"])], IsolatedAttention, dtypes=("float32", "bfloat16", "float16"),
                 only={"batch1", "ragged"})
    assert {f.metrics["dtype"] for f in res.findings if f.status == "fail"} == {"float16"}
    assert any(fault.expect in p for p in res.patterns[f"{b['impl']} ({b['contract']})"])


def test_a_kernel_that_raises_crashes_or_breaks_the_contract_is_reported_per_case(tmp_path):
    (tmp_path / "bad.py").write_text(
        "import os, torch\n"
        "def prefill(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):\n"
        "    if q.shape[0] == 37: raise RuntimeError('boom')\n"
        "    if q.shape[0] == 29: os.abort()\n"
        "    return torch.zeros(q.shape[0], q.shape[1], 3)\n")
    spec = f"{tmp_path / 'bad.py'}:prefill"
    res = ca.run(GLM, [(spec, "prefill")], IsolatedAttention, dtypes=("float32",), only={"batch1", "ragged", "decode-batch"})
    why = {f.target.split("/")[0]: f.reason for f in res.findings}
    assert all(f.status == "fail" for f in res.findings) and len(why) == 3
    assert why["batch1"].startswith("kernel raised: RuntimeError: boom")
    assert why["ragged"].startswith("kernel crashed: killed by SIGABRT")
    assert why["decode-batch"].startswith("contract violation: out: returned shape")


NOT_IMPLEMENTED = """
def f(*args, **kwargs):
    raise NotImplementedError("not for these shapes")
"""


def test_named_subject_that_skips_every_case_is_exit_2(tmp_path):
    from typer.testing import CliRunner

    from llmdoctor.cli import app

    k = tmp_path / "ni.py"
    k.write_text(NOT_IMPLEMENTED)
    r = CliRunner().invoke(app, ["check", "attention", "--preset", "gemma3-270m", "--impl", f"{k}:f",
                                 "--contract", "prefill", "--subjects", "sdpa-math", "--dtype", "float32",
                                 "--cases", "batch1", "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 2 and doc["counts"]["passed"] >= 1, doc["counts"]  # sdpa-math passed, the impl never ran
    for args, says in ((["--subjects", ","], "names no subject"), (["--timeout", "0"], "must be > 0"),
                       (["--preset", "llama-3-8b", "--impl", f"{k}:f", "--contract", "mla-decode"], "no mla-decode cases")):
        r = CliRunner().invoke(app, ["check", "attention", *args])
        assert r.exit_code == 2 and says in r.stderr, r.stderr


# ----------------------------------------------------------------------------- issue 16 / 18

PLAIN, BLOCKED = "llmdoctor.faults.attention:prefill", "llmdoctor.faults.attention:prefill_blocked"


def test_float32_bound_passes_two_summation_orders_and_faults_still_fail():
    """Plain (one softmax) and blocked online-softmax (tiles of 64, lse +inf on an empty row as flash-attn 2)
    kernels both pass in float32 under the derived bound; the planted faults still fail there."""
    only = {"ragged", "chunked", "long-keys"}  # chunked has an empty context chunk: lse +inf from the blocked kernel
    subjects = [(PLAIN, "prefill"), (BLOCKED, "prefill"), ("llmdoctor.faults.attention:prefill_last_1024", "prefill"),
                ("llmdoctor.faults.attention:prefill_top_left", "prefill")]
    res = ca.run(GLM, subjects, IsolatedAttention, dtypes=("float32",), only=only)
    for spec in (PLAIN + " ", BLOCKED + " "):
        mine = _by(res.findings, spec)
        assert len(mine) == 3 and all(f.status == "pass" for f in mine), [(f.target, f.reason) for f in mine]
        assert all(f.budget["rule"] == budgets.F32_RULE and 0 < f.metrics["bound_used"] < 1 for f in mine)
    capped = {f.target: f for f in _by(res.findings, "llmdoctor.faults.attention:prefill_last_1024")}
    assert capped["long-keys/float32"].status == "fail"
    assert "more than 700 keys fail" in capped["long-keys/float32"].explanation
    assert all(f.status == "pass" for t, f in capped.items() if t != "long-keys/float32")
    top_left = _by(res.findings, "llmdoctor.faults.attention:prefill_top_left")
    assert any(f.status == "fail" and "top-left" in f.explanation for f in top_left)


@pytest.mark.gpu
def test_float32_bound_on_cuda_judges_as_on_the_cpu():
    """On CUDA the per-element float32 bound is compared with errors gathered on the CPU (the H200 run
    crashed on the mix): the two correct orders pass, the capped kernel fails its long case."""
    capped = "llmdoctor.faults.attention:prefill_last_1024"
    res = ca.run(GLM, [(PLAIN, "prefill"), (BLOCKED, "prefill"), (capped, "prefill")], IsolatedAttention, device="cuda",
                 dtypes=("float32",), only={"ragged", "long-keys"})
    for spec in (PLAIN + " ", BLOCKED + " "):
        mine = _by(res.findings, spec)
        assert len(mine) == 2 and all(f.status == "pass" and f.metrics["bound_used"] < 1 for f in mine), mine
    bad = {f.target: f.status for f in _by(res.findings, capped)}
    assert bad == {"ragged/float32": "pass", "long-keys/float32": "fail"}, bad


def test_rounding_bound_holds_for_a_float32_order_and_is_linear_in_the_keys():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n, 2, 64, generator=g, dtype=torch.float64) for n in (4, 2000, 2000))
    allowed = torch.ones(4, 2000, dtype=torch.bool)
    exact, _ = attn.partial_attention(q, k, v, allowed, scale=0.125)
    f32, _ = attn.partial_attention(q.float(), k.float(), v.float(), allowed, scale=0.125)
    bound, lse_bound = budgets.rounding_bound(q, k, v, allowed, scale=0.125, u=budgets.F32_U)
    assert ((f32.double() - exact).abs() <= bound).all()
    short, _ = budgets.rounding_bound(q, k[:200], v[:200], allowed[:, :200], scale=0.125, u=budgets.F32_U)
    assert 2 < float(bound.mean() / short.mean()) < 20 and (lse_bound > 0).all()


def test_topk_cases_are_what_indexers_emit():
    """Distinct positions up to the causal limit (reached in some rows), -1 only as a suffix pad."""
    for case in suite.cases(GLM):
        if not case.top_k or case.probe:
            continue
        x = inputs.make_inputs(GLM, case, 0)
        r, reached = 0, 0
        for t, s in case.seqs:
            for i in range(t):
                row, last = x["topk"][r].tolist(), s - t + i
                n = sum(p >= 0 for p in row)
                assert n == min(case.top_k, last + 1) and all(p == -1 for p in row[n:]), case.name
                assert len(set(row[:n])) == n and all(0 <= p <= last for p in row[:n]), case.name
                reached += last in row
                r += 1
        assert reached, case.name
    assert any(c.top_k == GLM.top_k and max(s for _, s in c.seqs) > 4096 for c in suite.cases(GLM))


def test_a_sparse_kernel_that_counts_duplicates_passes_and_the_probe_is_information():
    spec = "llmdoctor.faults.attention:mla_sparse_decode_iterating"
    res = ca.run(GLM, [(spec, "mla-sparse-decode"), ("llmdoctor.faults.attention:mla_sparse_decode", "mla-sparse-decode")],
                 IsolatedAttention, dtypes=("bfloat16",), only={"sparse-decode", "sparse-decode-duplicates"})
    assert all(f.status == "pass" for f in res.findings), [(f.target, f.reason) for f in res.findings]
    said = {f.subject.split(":")[1].split(" ")[0]: f.reason for f in res.findings if f.target.startswith("sparse-decode-dup")}
    assert "information" in said["mla_sparse_decode_iterating"] and "as often as it is listed" in said[
        "mla_sparse_decode_iterating"]
    assert "counts a duplicate once" in said["mla_sparse_decode"]


def test_a_case_is_judged_on_the_same_inputs_whatever_the_selection():
    sel = [inputs.make_inputs(GLM, c, inputs.case_seed(0, c)) for c in suite.cases(GLM) if c.name == "long"]
    again = [inputs.make_inputs(GLM, c, inputs.case_seed(0, c)) for c in suite.cases(GLM)[::-1] if c.name == "long"]
    assert all(torch.equal(sel[0][n], again[0][n]) for n in sel[0])
    assert inputs.case_seed(0, suite.cases(GLM)[0]) != inputs.case_seed(1, suite.cases(GLM)[0])


def test_bytes_changed_on_the_way_to_the_subject_give_no_verdict():
    """Issue 18: what reaches the child is checked (crc32 both ways); a changed request is refused."""
    import zlib

    from llmdoctor.subjects.isolation import Isolated

    case = suite.cases(GLM)[0]
    x = inputs.make_inputs(GLM, case, 0)
    payload = bytearray(subj.pack({"args": [x["q"].float(), x["k"].float(), x["v"].float(), x["cu_q"], x["cu_k"],
                                            37, 37, GLM.scale, True], "kwargs": {}}))
    crc = zlib.crc32(payload)
    payload[-100] ^= 1
    with Isolated("llmdoctor.subjects.attention:serve", (PLAIN, "cpu", "prefill")) as iso:
        iso.start()
        r = iso.call({"contract": "prefill", "out_shape": [37, 2, 256], "lse_shape": [2, 37], "crc32": crc}, payload)
    assert r.status == "transport"
    got = AttentionReply("transport", r.message)
    assert verdicts.judge(GLM, case, x, got, None, "float32", PLAIN).status == "skip"
