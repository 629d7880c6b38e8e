"""Running a command again and comparing its JSON documents, shared by the determinism tests and
bench/bench_determinism.py (its long form): what legitimately changes between identical runs (wall-clock
times) is left out, and the first difference is named."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import Any, Iterator


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


def run_json(argv: list[str]) -> tuple[Any, int]:
    """(the JSON document, exit code) of `python -m llmdoctor.cli *argv` in a fresh process."""
    p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", *argv], capture_output=True, text=True)
    try:
        return json.loads(p.stdout), p.returncode
    except json.JSONDecodeError:
        return {"no JSON": p.stderr[-500:]}, p.returncode


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
