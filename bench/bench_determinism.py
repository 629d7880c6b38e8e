"""Run-to-run determinism (issue 18): the same command, run again and again on a loaded machine, must
give identical findings and numbers every time. One function per command (`bench_<command>`), 50 runs
by default; each prints identical/different (with the first difference) and the run timings.

    python bench/bench_determinism.py diagnose [--runs 50] [--load 2]
    python bench/bench_determinism.py check-dequant [--runs 50] [--load 2]
    python bench/bench_determinism.py check-attention [--runs 50] [--load 2] [--device cuda]

`--load N` keeps N extra processes spinning on the CPU for the whole campaign (a loaded machine).
What legitimately changes from run to run is left out of the comparison: wall-clock times (`is_time`).
tests/cli/test_determinism.py runs the same comparison in a bounded form (tests/rerun.py holds what both use).

Adding a command: write `bench_<name>(runs: int) -> list[Outcome]` that calls `repeat` with the
command's argv, and add it to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from rerun import cpu_load, first_difference, run_json, stable  # shared with the tests

@dataclass
class Outcome:
    """A command run `runs` times: how many runs differed from the first, the first difference, times."""

    name: str
    runs: int
    different: int = 0
    first_difference: str | None = None
    exit_codes: set = field(default_factory=set)
    seconds: list = field(default_factory=list)

    def line(self) -> str:
        verdict = "identical" if not self.different else f"DIFFERENT in {self.different} of {self.runs - 1} reruns"
        t = self.seconds
        return (f"{self.name}: {self.runs} runs {verdict} (exit codes {sorted(self.exit_codes)}); "
                f"s/run min {min(t):.1f} median {statistics.median(t):.1f} max {max(t):.1f}"
                + (f"\n    first difference: {self.first_difference}" if self.first_difference else ""))


def repeat(name: str, argv: list[str], runs: int, on_run: Callable[[int, float], None] = lambda i, s: None) -> Outcome:
    """Run `python -m llmdoctor.cli *argv` (which must print one JSON document) `runs` times and compare
    every run's stable part with the first's."""
    out = Outcome(name, runs)
    first = None
    for i in range(runs):
        t0 = time.perf_counter()
        doc, code = run_json(argv)
        doc = stable(doc)
        out.seconds.append(time.perf_counter() - t0)
        out.exit_codes.add(code)
        if first is None:
            first = doc
        elif (d := first_difference(first, doc)) is not None:
            out.different += 1
            out.first_difference = out.first_difference or f"run {i + 1}: {d}"
        on_run(i, out.seconds[-1])
    print(out.line(), flush=True)  # as soon as it is known: a campaign cut short keeps what finished
    return out


# ---- one function per command ---------------------------------------------------------------------

def bench_diagnose(runs: int, device: str) -> list[Outcome]:
    """`diagnose` on the demo deployment (llama.cpp): findings, layer budgets and the layer curve."""
    _cpu_only("diagnose", device)
    return [repeat("diagnose (demo, llama.cpp)", ["diagnose", "--json"], runs, _progress)]


def bench_check_dequant(runs: int, device: str) -> list[Outcome]:
    """`check dequant` on the demo model with the built-in kernels and with llama.cpp's (ggml)."""
    _cpu_only("check-dequant", device)
    return [repeat(f"check dequant --kernel {k}", ["check", "dequant", "--json", "--kernel", k], runs, _progress)
            for k in ("torch", "native", "ggml")]


def bench_check_attention(runs: int, device: str) -> list[Outcome]:
    """`check attention` as issue 18 ran it (glm-5, a plain float32 prefill kernel, every prefill case and the
    consistency pair), and llama-3-8b in every dtype with the online-softmax kernel (another summation order)."""
    def cmd(preset: str, kernel: str, dtype: str) -> list[str]:
        return ["check", "attention", "--preset", preset, "--impl", f"llmdoctor.faults.attention:{kernel}",
                "--contract", "prefill", "--device", device, "--dtype", dtype, "--json"]

    return [repeat("check attention glm-5 float32 (plain kernel)", cmd("glm-5", "prefill", "float32"), runs, _progress),
            repeat("check attention llama-3-8b all dtypes (online-softmax kernel)",
                   cmd("llama-3-8b", "prefill_blocked", "float32,bfloat16,float16"), runs, _progress)]


def _cpu_only(command: str, device: str) -> None:
    if device != "cpu":
        raise SystemExit(f"{command}: runs on the CPU only (its engine and kernels are the CPU's); drop --device")


COMMANDS: dict[str, Callable[[int, str], list[Outcome]]] = {
    "diagnose": bench_diagnose,
    "check-dequant": bench_check_dequant,
    "check-attention": bench_check_attention,
}


def _progress(i: int, seconds: float) -> None:
    print(f"  run {i + 1}: {seconds:.1f} s", file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=sorted(COMMANDS))
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--load", type=int, default=2, help="extra CPU-spinning processes meanwhile")
    ap.add_argument("--device", default="cpu", help="check-attention only: where the kernel and reference run")
    a = ap.parse_args()
    print(f"{a.command}: {a.runs} runs on {a.device}, {os.cpu_count()} cores, {a.load} spinning processes", flush=True)
    with cpu_load(a.load):
        outcomes = COMMANDS[a.command](a.runs, a.device)
    sys.exit(1 if any(o.different for o in outcomes) else 0)


if __name__ == "__main__":
    main()
