"""Servers the tests start on 127.0.0.1: a free port, then a process polled until its health URL
answers 200, stopped by its PID afterwards (terminate, then kill after a grace period)."""

from __future__ import annotations

import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(cmd: list[str], port: int, log: Path, *, name: str, health: str, ready_s: float,
          stop_s: float = 15) -> Iterator[str]:
    """Run `cmd` (listening on `port`) with its output in `log`; yield its URL once `health` answers."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                pytest.fail(f"{name} exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + health, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"{name} not ready after {ready_s:.0f} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(stop_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
