"""`llmdoctor check dequant`: planted faulty kernels are caught and named, correct kernels pass.

Runs on small `--only` subsets of the demo model; every run starts one isolated kernel child.
"""

import json

import numpy as np
import pytest
import torch
from bitcheck import bits_equal
from gguf_builders import every_type_file
from typer.testing import CliRunner

from llmdoctor import faults
from llmdoctor.checks.kernels import dequant
from llmdoctor.checks.layout import layout_bugs
from llmdoctor.gguf.block_layout import BLOCKS
from llmdoctor.cli import app
from llmdoctor.demo import model_path
from llmdoctor.errors import InputError
from llmdoctor.faults.kernels import DEMO_TARGET
from llmdoctor.subjects.kernels import IsolatedKernel

LAYOUT = ["nibble_swap", "qh_misplaced", "scale_min_swap", "subblock_order", "d_sign", "dmin_half",
          "unsigned_quants", "transposed", "rows_shifted", "rows_wrapped", "tail_unwritten", "wrong_type"]


@pytest.fixture(scope="module")
def demo():
    return model_path()


def _run(demo, name, **kw):
    return dequant.run(demo, IsolatedKernel, kernel=faults.get(name).build(), only=DEMO_TARGET[name], **kw)


@pytest.mark.slow
@pytest.mark.parametrize("name", LAYOUT)
def test_planted_layout_bug_is_named(demo, name):
    res = _run(demo, name)
    failed = [f for f in res.findings if f.status == "fail"]
    assert failed, f"{name}: the check did not fail"
    expect = faults.get(name).expect
    for f in failed:
        assert f"layout bug: {expect}" in f.reason, (name, f.reason)
        assert f.metrics["worst_block"]["file_offset"] >= f.metrics["offset"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["raises", "segfault", "aborts", "wrong_shape", "returns_nan"])
def test_faulty_subject_is_reported_and_the_check_goes_on(demo, name):
    res = _run(demo, name)
    assert len(res.findings) == 2  # attn_k and attn_v: the second tensor is still checked
    for f in res.findings:
        assert f.status == "fail" and faults.get(name).expect in f.reason, f.reason
    if name in ("segfault", "aborts"):
        assert "killed by SIG" in res.findings[0].reason and res.restarts == 1


@pytest.mark.slow
def test_hanging_kernel_times_out(demo):
    res = dequant.run(demo, IsolatedKernel, kernel=faults.get("hangs").build(), only="blk.0.attn_k.weight", timeout=2)
    (f,) = res.findings
    assert f.status == "fail" and "kernel hung" in f.reason


@pytest.mark.slow
@pytest.mark.parametrize("name,dtype", [("half_precision", None), ("half_precision_f32_out", None),
                                        ("half_precision", "float16")])
def test_correct_half_kernel_passes_as_reduced_precision(demo, name, dtype):
    res = dequant.run(demo, IsolatedKernel, kernel=faults.get(name).build(), dtype=dtype, only="blk.0.*")
    assert all(f.status == "pass" for f in res.findings)
    reduced = [f for f in res.findings if f.reason == "reduced-precision arithmetic"]
    assert {f.metrics["type"] for f in reduced} >= {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert all(f.metrics["bound_used"] <= 1 for f in reduced)


def test_reference_kernel_passes_bit_exact(demo):
    res = dequant.run(demo, IsolatedKernel, kernel="reference", only="blk.0.*")
    assert res.findings and all(f.status == "pass" and f.reason == "bit-exact" for f in res.findings)


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_our_kernels_pass_bit_exact(demo, kernel):
    res = dequant.run(demo, IsolatedKernel, kernel=kernel, only="blk.0.*")
    assert not [f for f in res.findings if f.status == "fail"], [f.reason for f in res.findings]
    assert all(f.reason for f in res.findings if f.status == "skip")
    passed = [f for f in res.findings if f.status == "pass"]
    assert len(passed) == len(res.findings) and all(f.reason == "bit-exact" for f in passed)


def test_native_kernel_on_cuda_is_skipped_with_the_reason():
    from llmdoctor.subjects.kernels import KernelUnavailable, load

    with pytest.raises(KernelUnavailable, match="CPU only"):
        load("native", "cuda")


LOSSY_F16 = """
import torch

def fn(raw, qtype, shape):
    # an F16 'kernel' that goes through bfloat16: float32 out, every value on the bfloat16 grid
    return raw.view(torch.float16).to(torch.bfloat16).to(torch.float32).reshape(shape)
"""


def test_lossy_conversion_is_not_excused_as_reduced_precision(tmp_path):
    from gguf import GGMLQuantizationType as Q
    from gguf_builders import write_file

    k = tmp_path / "lossy.py"
    k.write_text(LOSSY_F16)
    path = write_file(tmp_path / "f16.gguf", metadata=False,
                      tensors={"w": (Q.F16, (256,), np.random.default_rng(0).standard_normal(256).astype(np.float16))})
    res = dequant.run(path, IsolatedKernel, kernel=f"{k}:fn", blocks=256)
    assert [f.status for f in res.findings] == ["fail"], [(f.status, f.reason) for f in res.findings]


def test_ggml_agrees_with_gguf_py_on_the_demo_file(demo):
    """Cross-checks the oracle (gguf-py) against the C code llama.cpp runs, on every tensor."""
    res = dequant.run(demo, IsolatedKernel, kernel="ggml", blocks=64)
    by_status = {s: [f for f in res.findings if f.status == s] for s in ("pass", "fail", "skip")}
    assert not by_status["fail"]
    assert len(by_status["pass"]) == 127  # every quantized tensor
    assert all(f.reason == "bit-exact" for f in by_status["pass"])
    assert all("f32 has no to_float" in f.reason for f in by_status["skip"])  # the 109 F32 norms


def test_reduced_precision_bound_catches_an_error_just_above_it():
    want = torch.tensor([0.25, -1.5, 3e-6, 0.0], dtype=torch.float32)
    m = torch.tensor([0.1, 0.0, 0.0, 0.0], dtype=torch.float32)
    bound = dequant.reduced_precision_bound(want, m, torch.float16)
    judge = dequant.Judge(torch.float16)
    inside = (want.double() + 0.99 * bound).float()
    outside = (want.double() + 1.5 * bound).float()
    assert not judge.bad(inside, want, m).any()
    assert judge.bad(outside, want, m).all()
    assert dequant.Judge(None).bad(inside, want, m).any()  # float32 must be bit-exact


def test_choose_blocks_is_seeded_and_keeps_the_ends():
    a = dequant.choose_blocks(10_000, 50, 0, "x")
    assert len(a) == 50 and a[0] == 0 and a[-1] == 9_999
    assert np.array_equal(a, dequant.choose_blocks(10_000, 50, 0, "x"))
    assert not np.array_equal(a, dequant.choose_blocks(10_000, 50, 1, "x"))
    assert np.array_equal(dequant.choose_blocks(3, 50, 0, "x"), [0, 1, 2])


def test_layout_bug_candidates_on_min_types():
    """Q4_1: d and m swapped, sign of d; Q8_0 a planted output transform: no false naming."""
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (64, 20), dtype=np.uint8)
    raw[:, 0:4] = np.frombuffer(rng.uniform(-1, 1, 128).astype(np.float16).tobytes(), np.uint8).reshape(64, 4)
    t = layout_bugs.Tensor(layout_bugs.T.Q4_1, (2, 1024), raw.reshape(-1))
    idx = np.arange(64)
    swapped = raw.copy()
    swapped[:, 0:2], swapped[:, 2:4] = raw[:, 2:4], raw[:, 0:2]
    got = layout_bugs.reference(layout_bugs.T.Q4_1, swapped)

    def exact(expected, keep):
        return bits_equal(got[keep], expected[keep], nan_equal=False)

    assert layout_bugs.explain(t, idx, exact).name == "d/dmin from the wrong half"
    got = layout_bugs.reference(layout_bugs.T.Q4_1, raw) * 1.5
    assert layout_bugs.explain(t, idx, exact) is None


# ----------------------------------------------------------------------------- CLI

runner = CliRunner()


@pytest.mark.slow
def test_cli_pass_and_json_envelope():
    r = runner.invoke(app, ["check", "dequant", "--kernel", "reference", "--only", "blk.0.attn_v.weight", "--json"])
    assert r.exit_code == 0, r.output
    env = json.loads(r.stdout)
    assert env["schema"] == "llmdoctor.check.dequant/1" and env["verdict"] == "passed"
    assert env["counts"] == {"passed": 1, "failed": 0, "skipped": 0}
    assert env["by_type"]["Q8_0"]["mismatches"] == 0 and env["kernel"]["spec"] == "reference"
    assert env["env"]["file"]["sha256"] and env["env"]["seed"] == 0


@pytest.mark.slow
def test_cli_fail_names_the_bug_and_exits_1():
    spec = faults.get("d_sign").build()
    r = runner.invoke(app, ["check", "dequant", "--kernel", spec, "--only", "blk.0.attn_output.weight", "--json"])
    assert r.exit_code == 1
    (f,) = json.loads(r.stdout)["findings"]
    assert f["status"] == "fail" and "layout bug: sign of d" in f["explanation"]
    assert f["metrics"]["differing_bits"]["sign"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("args,message", [
    (["--kernel", "nosuch"], "not a built-in"),
    (["--kernel", "nosuchmodule_xyz:fn"], "cannot import"),
    (["--kernel", "/nonexistent/k.py:fn"], "no such file"),
    (["--kernel", "llmdoctor.faults.kernels:nosuchfn"], "has no function"),
    (["--device", "cuda"], "CUDA is not available"),
    (["--blocks", "4", "--all"], "exclude each other"),
    (["--blocks", "0"], "at least 1"),
    (["--only", "no.such.tensor"], "matches no tensor"),
    (["--seed", "-1"], "must be >= 0"),
    (["--timeout", "0"], "must be > 0"),
])
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    r = runner.invoke(app, ["check", "dequant", "--only", "blk.0.attn_v.weight", *args])
    assert r.exit_code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.slow
def test_cli_unavailable_kernel_is_skipped_with_reason_and_exit_2():
    r = runner.invoke(app, ["check", "dequant", "--kernel", "vllm", "--only", "blk.0.attn_v.weight", "--json"])
    assert r.exit_code == 2
    env = json.loads(r.stdout)
    assert env["verdict"] == "skipped" and env["counts"]["skipped"] == 1
    assert "vllm" in env["findings"][0]["reason"]


def test_run_validates_before_starting(demo):
    with pytest.raises(InputError):
        dequant.run(demo, IsolatedKernel, kernel="torch", dtype="float8")


@pytest.mark.slow
def test_kernel_from_a_py_file_and_an_unexplained_error(demo, tmp_path):
    """A `path.py:function` kernel that is off by one ulp in one element: bit-exact fails, no layout
    bug reproduces it, the evidence shows the element."""
    k = tmp_path / "my_kernel.py"
    k.write_text(
        "import torch, gguf\n"
        "def dequant(raw, qtype, shape, dtype=None):\n"
        "    out = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).reshape(shape).clone()\n"
        "    out[0, 5] = torch.nextafter(out[0, 5], torch.tensor(9.0))\n"
        "    return out\n")
    res = dequant.run(demo, IsolatedKernel, kernel=f"{k}:dequant", only="blk.0.attn_v.weight")
    (f,) = res.findings
    assert f.status == "fail" and f.reason.endswith("unexplained") and "1 of" in f.reason
    assert f.evidence[0]["element"] == [0, 5]
    assert f.metrics["differing_bits"]["elements"] == 1 and f.metrics["differing_bits"]["max_ulp"] == 1
    assert f.metrics["worst_block"]["index"] == 0
    assert res.by_type["Q8_0"]["worst_block"]["tensor"] == "blk.0.attn_v.weight"


BYTE_CANDIDATES_BY_TYPE = {
    "Q4_0": {"nibble order swapped", "sign of d", "signed/unsigned quants"},
    "Q4_1": {"nibble order swapped", "sign of d", "d/dmin from the wrong half"},
    "Q5_0": {"nibble order swapped", "high bits (qh) misplaced", "sign of d", "signed/unsigned quants"},
    "Q5_1": {"nibble order swapped", "high bits (qh) misplaced", "sign of d", "d/dmin from the wrong half"},
    "Q8_0": {"sign of d", "signed/unsigned quants"},
    "Q2_K": {"scale and min swapped", "sub-block scale order", "sign of d", "d/dmin from the wrong half"},
    "Q4_K": {"nibble order swapped", "scale and min swapped", "sub-block scale order", "sign of d",
             "d/dmin from the wrong half"},
    "Q5_K": {"nibble order swapped", "high bits (qh) misplaced", "scale and min swapped", "sub-block scale order",
             "sign of d", "d/dmin from the wrong half"},
    "Q6_K": {"nibble order swapped", "high bits (qh) misplaced", "sub-block scale order", "sign of d"},
    "IQ4_NL": {"nibble order swapped", "sign of d"},
}


@pytest.mark.parametrize("tname", sorted(BYTE_CANDIDATES_BY_TYPE))
def test_block_candidates_change_the_output_and_are_told_apart(tname):
    """On random blocks (finite scales) each block-level candidate of a type changes the values, and
    the search names it and not an earlier candidate."""
    from gguf import GGML_QUANT_SIZES

    q = layout_bugs.T[tname]
    bs, ts = GGML_QUANT_SIZES[q]
    rng = np.random.default_rng(1)
    b = rng.integers(0, 256, (64, ts), dtype=np.uint8)
    for name in ("d", "dmin", "m"):
        f = BLOCKS[q].get(name)
        if f is not None:
            b[:, f.offset:f.end] = np.frombuffer(rng.uniform(0.01, 1, 64).astype(np.float16).tobytes(), np.uint8).reshape(64, 2)
    t = layout_bugs.Tensor(q, (8, 8 * bs), b.reshape(-1))
    idx = np.arange(64)
    ref = layout_bugs.reference(q, b)
    named = set()
    for c in layout_bugs.CANDIDATES[:7]:  # the block-level ones
        got = c.expected(t, idx)
        if got is None:
            continue
        assert not bits_equal(got, ref, nan_equal=False), c.name
        found = layout_bugs.explain(t, idx, lambda e, keep: bits_equal(got[keep], e[keep], nan_equal=False))
        assert found is c, (c.name, found and found.name)
        named.add(c.name)
    assert named == BYTE_CANDIDATES_BY_TYPE[tname]


# ----------------------------------------------------------------------------- isolation


def echo_factory(tag):
    """A handler for Isolated (imported by the child from this module): reverses the payload."""

    def handle(header, payload):
        payload[0] ^= 0xFF  # the child's copy is private and writable
        return {"tag": tag, "n": len(payload)}, bytes(payload[::-1])

    return handle


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_isolated_round_trips_payloads_through_shared_file_or_socket(shared, monkeypatch):
    from llmdoctor.subjects import isolation

    if not shared:
        monkeypatch.setattr(isolation, "_Bulk", lambda: (_ for _ in ()).throw(OSError("no shm")))
    data = (np.arange(3 << 20) % 251).astype(np.uint8)
    with isolation.Isolated("test_check_dequant:echo_factory", ("x",)) as iso:
        for n in (10, 3 << 20):  # the second grows the shared file past its first MiB
            o = iso.call({}, data[:n], reply_hint=n)
            want = bytearray(data[:n])
            want[0] ^= 0xFF
            assert o.status == "ok" and o.header["tag"] == "x" and o.header["n"] == n
            assert o.payload == want[::-1]
            assert bool(o.header.get("in_bulk")) == shared
    assert data[0] == 0  # the parent's bytes were never touched


@pytest.fixture(scope="module")
def every_type_gguf(tmp_path_factory):
    return every_type_file(tmp_path_factory.mktemp("types") / "every_type.gguf")


def test_ggml_agrees_with_gguf_py_on_every_type(every_type_gguf):
    """The oracle against llama.cpp's C code on random blocks of every type, every block compared."""
    res = dequant.run(every_type_gguf, IsolatedKernel, kernel="ggml", all_blocks=True)
    fails = [(f.target, f.reason) for f in res.findings if f.status == "fail"]
    assert not fails
    passed = {f.metrics["type"] for f in res.findings if f.status == "pass"}
    assert len(passed) >= 20 and {"IQ1_M", "IQ4_XS", "Q2_K", "TQ1_0", "MXFP4", "BF16", "F16"} <= passed
    assert all(f.metrics["compared_blocks"] == f.metrics["n_blocks"] for f in res.findings if f.status == "pass")


def test_q4_1_decoded_as_q4_0_is_named(every_type_gguf):
    """The issue's example of a wrong type assumed: a Q4_1 tensor decoded as Q4_0."""
    res = dequant.run(every_type_gguf, IsolatedKernel, kernel=faults.get("wrong_type").build(), only="t.Q4_1")
    (f,) = res.findings
    assert f.status == "fail" and "layout bug: wrong type assumed (Q4_0)" in f.reason


def test_working_precision_of_outputs_that_are_not_bit_exact():
    x = torch.randn(1000)
    assert dequant._working_precision(x.double()) == torch.float32  # may be more exact than the reference
    assert dequant._working_precision(x.half().float()) == torch.float16  # computed in float16
    assert dequant._working_precision(x.bfloat16().float()) == torch.bfloat16
    assert dequant._working_precision(x) is None  # genuine float32: must be bit-exact


def test_near_cancellation_is_thousands_of_ulps_off_yet_within_the_bound(demo):
    """Q4_K in float16 (d·sc·q - dmin·m): where d·q ≈ m the result is >1000 float16 ulps from the
    rounded reference, yet inside the derived bound, which no element of the correct kernel exceeds."""
    from llmdoctor.checks import metrics
    from llmdoctor.faults.kernels import _decode
    from llmdoctor.gguf import open_gguf

    with open_gguf(demo) as g:
        t = g.tensor("blk.0.attn_output.weight")
        b = np.array(t.data).reshape(-1, t.type_size)
        got = _decode(torch.from_numpy(b.reshape(-1)), int(t.type), t.shape, ct=torch.float16).reshape(-1)
    ref = torch.from_numpy(layout_bugs.reference(t.type, b)).reshape(-1)
    m = torch.from_numpy(layout_bugs.min_part(t.type, b)).reshape(-1)
    assert int(metrics.ulp_distance(got, ref.half()).max()) > 1000
    assert not dequant.Judge(torch.float16).bad(got, ref, m).any()


def test_bound_has_teeth_bfloat16_arithmetic_returned_as_float16(demo, tmp_path):
    """A kernel that returns float16 but computed in bfloat16 (3 bits short) fails the float16 bound."""
    k = tmp_path / "bf16_as_f16.py"
    k.write_text("import torch\nfrom llmdoctor.faults.kernels import _decode\n"
                 "def dequant(raw, qtype, shape, dtype=None):\n"
                 "    return _decode(raw, qtype, shape, ct=torch.bfloat16).half()\n")
    res = dequant.run(demo, IsolatedKernel, kernel=f"{k}:dequant", only="blk.0.attn_output.weight")
    (f,) = res.findings
    assert f.status == "fail" and "beyond the float16 rounding bound" in f.reason


OVERFLOW_KERNEL = (
    "import torch, gguf\n"
    "def fn(raw, qtype, shape, dtype=None):\n"
    "    out = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype)).reshape(shape).to(torch.float16)\n"
    "    if PLANT == 'sign':\n"
    "        out[out.isinf()] = -out[out.isinf()]\n"
    "    if PLANT == 'in-range':\n"
    "        out[0, 1] = float('inf')\n"
    "    return out\n")


@pytest.mark.slow
@pytest.mark.parametrize("plant", [None, "sign", "in-range"])
def test_float16_overflow_beyond_its_range_is_reported_not_failed(plant, tmp_path):
    """vLLM's GGUF dequant on the H200 (half precision) gave -inf where the reference is -94,552.5 (an IQ1_M
    block of random scales): float16 has no such number, so ±inf is what a float16 kernel must give. Such
    elements pass and are reported; an infinity of the wrong sign, or one where the reference fits float16,
    still fails."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize
    from gguf_builders import write_file

    x = np.random.default_rng(0).uniform(-1, 1, (4, 64)).astype(np.float32)
    x[0, 0], x[1, 3], x[0, 1] = 120000.0, -90000.0, 0.5  # blocks whose largest values exceed float16's 65,504
    k = tmp_path / "kernel.py"
    k.write_text(f"PLANT = {plant!r}\n" + OVERFLOW_KERNEL)
    path = write_file(tmp_path / "big.gguf", metadata=False, tensors={"w": (Q.Q8_0, (64, 4), quantize(x, Q.Q8_0))})
    (f,) = dequant.run(path, IsolatedKernel, kernel=f"{k}:fn", all_blocks=True).findings
    if plant is None:
        assert f.status == "pass" and f.metrics["overflow_elements"] >= 2, (f.status, f.reason, f.metrics)
        assert f.metrics["overflow_reference_max"] > 65504
        assert "beyond float16's range" in f.explanation and "come out ±inf" in f.explanation, f.explanation
        from rich.console import Console

        from llmdoctor.report.terminal import render_dequant

        console = Console(record=True, width=200)
        render_dequant("fn", {}, [f], "passed", console=console)
        text = console.export_text()
        assert "note w: " in text and "come out ±inf" in text, text
    else:
        assert f.status == "fail" and "NaN/inf where the reference is finite" in f.reason, (f.status, f.reason)
