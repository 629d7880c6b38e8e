"""Hostile files: each hardening rule rejected with the right message, bounded time and memory."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

from llmdoctor import faults
from llmdoctor.gguf import GGUFError, open_gguf

HOSTILE = faults.all_faults("hostile-file")
HANG_GUARD_S = 5
PEAK_BYTES = 16 * 2**20  # Python allocations beyond the mmap


class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang()


def test_corpus_covers_every_rule():
    names = {f.name for f in HOSTILE}
    assert len(names) >= 30
    for must in ("array-2-40-u8", "tensors-overlap", "offset-past-end", "duplicate-key", "nested-array"):
        assert must in names


@pytest.mark.parametrize("fault", HOSTILE, ids=lambda f: f.name)
def test_hostile_file_rejected_bounded(tmp_path, fault):
    path = tmp_path / f"{fault.name}.gguf"
    path.write_bytes(fault.build())
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_GUARD_S)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(GGUFError) as exc:
            open_gguf(path)
    except _Hang:
        pytest.fail(f"{fault.name}: no verdict within {HANG_GUARD_S} s")
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    msg = str(exc.value)
    assert fault.expect in msg, msg
    assert msg.startswith(str(path)), msg
    assert exc.value.offset is not None and " at offset " in msg
    assert peak < PEAK_BYTES, f"{fault.name}: {peak} bytes allocated"
    assert elapsed < HANG_GUARD_S


def test_array_2_40_file_is_tiny():
    assert len(faults.get("array-2-40-u8").build()) == 49


def test_cli_one_line_error_exit_2(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(faults.get("tensors-overlap").build())
    p = subprocess.run([sys.executable, "-m", "llmdoctor.cli", "inspect", str(path)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: {path}: ") and "overlaps" in lines[0] and "at offset" in lines[0]
    assert p.stdout == ""
