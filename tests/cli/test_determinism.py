"""Issue 18: the same command gives identical findings and numbers run after run, on a loaded machine.

Bounded for CI (a rerun under CPU load; diagnose's is in test_diagnose.py, beside the run it repeats);
bench/bench_determinism.py runs the long form (50 runs). The cause found for `diagnose`'s budgets:
torch's thread count is one setting for the whole process, and the dequant pool's threads set it to 1
when they started, racing with the caller's restore: after the first multi-chunk dequant, the
process's later ops (the reference and its emulated run) ran on one thread or on all, depending on
timing, and reductions may give other bits on other thread counts (measured: MKL's product
[54, 256] x [256, 54] differs from 8 threads on, a full float32 sum between 1 and 4 threads; the demo's
reference itself was bit-identical at 1 and 16 threads on the 2-core dev machine), which the
emulation's Q8 rounding would turn into another budget.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from llmdoctor.gguf import dequantize

import rerun as bd

pytestmark = pytest.mark.slow


def test_dequant_pool_threads_leave_torchs_thread_count_alone(monkeypatch):
    """Only the calling thread sets torch's (process-wide) thread count, and it restores it."""
    real = torch.set_num_threads
    callers = []

    def spy(n: int) -> None:
        callers.append(threading.current_thread().name)
        real(n)

    monkeypatch.setattr(torch, "set_num_threads", spy)
    before = torch.get_num_threads()
    real(before + 1)  # another worker count: a fresh pool, whose threads start now
    try:
        raw = np.random.default_rng(0).integers(0, 256, (2048 * 2048 // 32) * 34, dtype=np.uint8)
        raw[::34] = raw[1::34] = 0  # d = 0 in every Q8_0 block: finite values
        dequantize(raw, Q.Q8_0, (2048, 2048), native=False)  # 4M values: several chunks, shared
        assert set(callers) == {threading.main_thread().name}, callers
        assert torch.get_num_threads() == before + 1
    finally:
        real(before)


def rerun_matches(argv: list[str], first: dict) -> None:
    """`llmdoctor *argv` in a fresh process, with one CPU-spinning process meanwhile, gives `first`
    (a document of the same command), wall-clock times and argv aside."""
    with bd.cpu_load(1):
        again, _ = bd.run_json(argv)
    a, b = (bd.stable({k: v for k, v in d.items() if k != "argv"}) for d in (first, again))
    assert bd.first_difference(a, b) is None, bd.first_difference(a, b)


@pytest.mark.parametrize("kernel", ["torch", "ggml"])
def test_check_dequant_is_repeatable_under_load(kernel):
    argv = ["check", "dequant", "--json", "--kernel", kernel, "--only", "blk.1[0-2].*"]
    first, _ = bd.run_json(argv)
    rerun_matches(argv, first)
