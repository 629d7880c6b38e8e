"""Run-to-run determinism (issue 18): the same command, run again and again on a loaded machine, must
give identical findings and numbers every time. One function per command (`bench_<command>`), 50 runs
by default; each prints identical/different (with the first difference) and the run timings.

    python bench/bench_determinism.py diagnose [--runs 50] [--load 2]
    python bench/bench_determinism.py check-dequant [--runs 50] [--load 2]
    python bench/bench_determinism.py check-attention [--runs 50] [--load 2] [--device cuda]

`--load N` keeps N extra processes spinning on the CPU for the whole campaign (a loaded machine).
What legitimately changes from run to run is left out of the comparison: wall-clock times (`is_time`).
tests/test_determinism.py runs the same functions in a bounded form (a few runs).

Adding a command: write `bench_<name>(runs: int) -> list[Outcome]` that calls `repeat` with the
command's argv, and add it to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

def is_time(key: str) -> bool:
    """Keys whose values are wall-clock measurements, which differ between identical runs: "seconds" and
    any key ending in "_seconds" or "_s" (check dequant's kernel_seconds, timings_s, wall_s, an engine's
    load_s)."""
    return key == "seconds" or key.endswith(("_seconds", "_s"))


def stable(doc: Any) -> Any:
    """`doc` without its wall-clock times (every `is_time` key, at any depth)."""
    if isinstance(doc, dict):
        return {k: stable(v) for k, v in doc.items() if not is_time(k)}
    if isinstance(doc, list):
        return [stable(v) for v in doc]
    return doc


def first_difference(a: Any, b: Any, path: str = "") -> str | None:
    """Where two JSON documents first differ ("findings[3].metrics.error: 0.1 != 0.2"), or None."""
    if type(a) is not type(b):
        return f"{path or '.'}: {a!r} != {b!r}"
    if isinstance(a, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}: only in {'the first' if k in a else 'this'} run"
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} items != {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    return None if a == b else f"{path or '.'}: {a!r} != {b!r}"


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


def run_json(argv: list[str]) -> tuple[Any, int]:
    """(the JSON document, exit code) of `python -m llmdoctor.cli *argv` in a fresh process."""
    p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", *argv], capture_output=True, text=True)
    try:
        return json.loads(p.stdout), p.returncode
    except json.JSONDecodeError:
        return {"no JSON": p.stderr[-500:]}, p.returncode


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


@contextlib.contextmanager
def cpu_load(n: int) -> Iterator[None]:
    """n processes spinning on the CPU meanwhile (ended, each by its own id, on exit)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


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
