"""The forensics accumulator's fast moments (checks/file/weight_moments.py: float32 passes centered on each
chunk's mean, merged in float64; the C passes and the torch ones) agree with float64 within the bound
derived in the module; its scale
statistics (counts of codes) agree with the per-value arithmetic; its numbers are the same for any
torch thread count; and the demo's verdicts are farther from the outlier limit than rounding can move them."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from llmdoctor.checks.file import block_scales as BS
from llmdoctor.checks.file import forensics as F
from llmdoctor.checks.file import forensics_native as FN
from llmdoctor.checks.file import sibling_outliers as SO
from llmdoctor.checks.file import tensor_stats as TS
from llmdoctor.gguf import dequantize, open_gguf

RMS_REL, MEAN_OVER_RMS, KURT_REL = 1.6e-4, 2.2e-4, 1e-3  # the module's derived bounds
Z_SHIFT = 0.03  # the most rounding can move a robust z at the limit (module notes)


def _exact(w: np.ndarray) -> tuple[float, float, float]:
    """(mean, rms, kurtosis) of the finite values, two-pass in float64."""
    w = w[np.isfinite(w)].astype(np.float64)
    mean = w.mean()
    d = w - mean
    var = (d * d).mean()
    return mean, math.sqrt((w * w).mean()), (d ** 4).mean() / var ** 2


def _stream(w: np.ndarray, chunk: int = 1 << 18) -> TS.TensorStats:
    acc = TS.Accumulator("t", QT.F32)
    for i in range(0, w.size, chunk):
        acc.add(None, torch.from_numpy(w[i:i + chunk]))
    return acc.finish()


def _cases() -> dict[str, np.ndarray]:
    g = np.random.default_rng(0)
    n = 600_007  # 3 chunks, the last partial: a row tail of 967 values, not a multiple of the C lanes (16)
    gauss = (g.standard_normal(n) * 0.02).astype(np.float32)
    shifted = gauss.copy()
    shifted[n // 2:] += 0.1  # chunk means 5 sigma apart
    with_bad = gauss.copy()
    with_bad[[7, 300_001]] = np.inf
    with_bad[400_000] = np.nan
    return {"gaussian": gauss, "norm-like (mean 1, sigma 1e-3)": (1 + g.standard_normal(n) * 1e-3).astype(np.float32),
            "heavy tails": g.laplace(size=n).astype(np.float32) ** 3, "tiny (1e-30)": gauss * np.float32(1e-28),
            "huge (1e30)": gauss * np.float32(1e32), "chunk means apart": shifted, "inf and nan": with_bad}


@pytest.fixture(params=["native", "torch"])
def passes(request, monkeypatch):
    """The C passes of _forensics_native.c (skipped where not built), or the torch passes."""
    if request.param == "native" and FN.NATIVE is None:
        pytest.skip("skipped: the native forensics passes are not built (no C compiler at install time?)")
    if request.param == "torch":
        monkeypatch.setattr(FN, "NATIVE", None)
    return request.param


@pytest.mark.parametrize("case", list(_cases()))
def test_moments_within_the_derived_bound(case, passes):
    w = _cases()[case]
    st = _stream(w)
    mean, rms, kurt = _exact(w)
    finite = w[np.isfinite(w)]
    assert st.n_values == w.size and st.nonfinite == w.size - finite.size
    assert st.max_abs == float(np.abs(finite).max())  # exact
    assert abs(st.rms - rms) <= RMS_REL * rms
    assert abs(st.mean - mean) <= MEAN_OVER_RMS * rms
    sigma = math.sqrt(max(rms * rms - mean * mean, 0.0))
    assert abs(st.kurtosis - kurt) <= KURT_REL * kurt * max(1.0, np.abs(finite.astype(np.float64)).mean() / sigma)
    if case == "inf and nan":
        assert st.first_nonfinite_block == 7


def test_same_numbers_for_any_thread_count_and_run(passes):
    w = _cases()["heavy tails"]
    keep = torch.get_num_threads()
    try:
        runs = []
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            runs.append(_stream(w).as_dict())
    finally:
        torch.set_num_threads(keep)
    assert runs[0] == runs[1] == runs[2]
    assert torch.get_num_threads() == keep


@pytest.fixture(scope="module")
def demo_tensors(demo_path):
    with open_gguf(demo_path) as g:
        picks = {}
        for t in g.tensors:  # the first blk.0/1 tensor of each type: every decoder and scale layout of the demo
            if t.name.startswith(("blk.0.", "blk.1.")) and t.type not in picks:
                picks[t.type] = t.name
        yield g, sorted(picks.values())


def test_demo_statistics_within_the_bound_and_scales_exact(demo_tensors, passes):
    g, names = demo_tensors
    assert len(names) >= 4  # Q4_K, Q5_0, Q6_K, F32 at least
    for name in names:
        t = g.tensor(name)
        w = dequantize(t.data, int(t.type), (t.n_elements,)).numpy()
        st = TS.tensor_stats(t)
        mean, rms, kurt = _exact(w)
        assert abs(st.rms - rms) <= RMS_REL * rms and abs(st.mean - mean) <= MEAN_OVER_RMS * rms, name
        assert abs(st.kurtosis - kurt) <= KURT_REL * kurt, name
        blocks = t.data.reshape(-1, t.type_size)
        for f in BS.SCALE_FIELDS.get(t.type, ()):
            s = BS.scale_values(blocks, f).astype(np.float64)  # per value, the plain way
            got = st.scales[f.name]
            a = np.abs(s)
            assert got["blocks"] == s.size
            assert got["negative"] == (s < 0).mean() and got["zero"] == (s == 0).mean()
            assert got["nonfinite"] == (~np.isfinite(s)).mean()
            assert got["subnormal"] == ((a > 0) & (a < BS.F16_MIN_NORMAL)).mean()
            lg = np.log2(a[np.isfinite(a) & (a > 0)])
            assert abs(got["log2_median"] - np.median(lg)) <= BS.BIN, (name, f.name)
            assert got["log2_max"] - BS.BIN / 2 <= lg.max() < got["log2_max"] + BS.BIN / 2
            ok = np.isfinite(s) & (s != 0)
            lg_all = np.where(ok, np.log2(np.where(ok, a, 1)), np.nan)
            jumps = np.abs(np.diff(lg_all))
            assert np.isclose(got["jitter"], jumps[np.isfinite(jumps)].mean(), rtol=1e-6), (name, f.name)


def test_demo_verdicts_farther_from_the_limit_than_rounding_moves_them(demo_path):
    _, stats = F.analyze(demo_path)
    _, summary = SO.outliers(stats)
    keep = SO.threshold
    SO.threshold = lambda n: 0.0  # every (tensor, metric) test reported with its robust z
    try:
        every, _ = SO.outliers(stats)
    finally:
        SO.threshold = keep
    assert 0 < len(every) <= summary["tests"]  # all but those exactly at their siblings' median (z = 0)
    assert max(o["robust_z"] for o in every) < summary["limit"] - Z_SHIFT


def test_native_passes_same_bits_for_any_build(tmp_path):
    """The C passes' summation order is fixed in the source: builds at -O0 and at -O3 for this CPU
    (vectorized, any ISA) give the same bits (compiled here; skipped without a C compiler)."""
    import ctypes
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("skipped: no C compiler")
    src = Path(FN.__file__).with_name("_forensics_native.c")
    x = (np.random.default_rng(1).laplace(size=100_003) ** 3).astype(np.float32)
    results = []
    for flags in (["-O0"], ["-O3", "-march=native"]):
        so = tmp_path / f"fx{len(results)}.so"
        subprocess.run([cc, "-shared", "-fPIC", *flags, "-ffp-contract=off", "-fno-fast-math",
                        f"-I{sysconfig.get_paths()['include']}", str(src), "-o", str(so), "-lm"], check=True)
        lib = ctypes.CDLL(str(so))
        lib.llmd_fx_scan.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
        lib.llmd_fx_central.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
        scan, central = np.zeros(4), np.zeros(3)
        lib.llmd_fx_scan(x.ctypes.data, x.size, scan.ctypes.data)
        lib.llmd_fx_central(x.ctypes.data, x.size, ctypes.c_float(0.01), central.ctypes.data)
        results.append(scan.tobytes() + central.tobytes())
    assert results[0] == results[1]
