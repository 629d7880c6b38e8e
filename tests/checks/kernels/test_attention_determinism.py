"""Issue 18, bounded form: the same `check attention` run, repeated on a loaded machine (a process
spinning on the CPU meanwhile), gives identical findings and numbers every time. The long form (50 runs
through the CLI) is `python bench/bench_determinism.py check-attention`."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from llmdoctor.checks.kernels import attention as ca
from llmdoctor.checks.kernels import attention_shapes as shapes
from llmdoctor.subjects.attention import IsolatedAttention

pytestmark = pytest.mark.slow

GLM = dataclasses.replace(shapes.PRESETS["glm-5"], n_head=2, n_head_kv=2)
RUNS = 5


@pytest.fixture
def cpu_load():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def _stable(res: ca.Result) -> list[dict]:
    """Everything a finding says except the kernel's wall-clock time."""
    out = []
    for f in res.findings:
        d = f.to_dict() if hasattr(f, "to_dict") else dataclasses.asdict(f)
        d["metrics"] = {k: v for k, v in d["metrics"].items() if k != "kernel_seconds"}
        out.append(d)
    return out


def test_check_attention_is_identical_from_run_to_run_under_load(cpu_load):
    subjects = [("llmdoctor.faults.attention:prefill_blocked", "prefill")]  # a fresh child each run
    runs = [_stable(ca.run(GLM, subjects, IsolatedAttention, dtypes=("float32",), only={"chunked", "long-keys"}))
            for _ in range(RUNS)]
    assert len(runs[0]) == 2 and all(f["status"] == "pass" for f in runs[0])
    for i, r in enumerate(runs[1:], 2):
        assert r == runs[0], f"run {i} differs from run 1"
