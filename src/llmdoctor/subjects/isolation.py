"""Run a subject in a child process with a timeout: a crash, hang or exception becomes a result.

One long-lived child per subject (a fresh interpreter: no inherited CUDA state, locks or mmaps, and,
unlike multiprocessing's 'spawn', no re-import of the caller's __main__) loads the subject once
through a handler factory ("module:function", called with `args` in the child) and then serves
requests one by one over a socket pair (multiprocessing.connection framing):

    request  = (header: dict, payload: bytes)   payload received into a fresh private bytearray
    reply    = handler(header, payload) -> (header: dict, payload: bytes-like)

The payload is copied through the pipe, so the subject only ever sees its own writable copy of the
bytes, never a view of the parent's read-only mmap (../shared/DESIGN.md, "Subjects are isolated").
If the child dies (segfault, abort, CUDA illegal address) or a call exceeds its timeout, the call's
`Outcome` says so and the next call starts a fresh child. The child's stdout is redirected to stderr
so that a chatty subject cannot corrupt `--json` output.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Optional


@dataclass
class Outcome:
    """What happened to one call. status: ok | raised | crashed | timeout (the handler's own reply
    header may carry a finer status, e.g. 'unsupported')."""

    status: str
    message: str = ""
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytearray = field(default_factory=bytearray)
    seconds: float = 0.0


class LoadFailed(Exception):
    """The child could not build its handler: `kind` is the exception's class name, `args[0]` its message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _resolve(factory: str) -> Any:
    module, _, name = factory.partition(":")
    return getattr(importlib.import_module(module), name)


def _child(fd: int) -> None:
    """The child's main loop (started as `python -c`): the first message is (sys.path, factory, args)."""
    try:  # no core files from a crashing subject
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, ValueError, OSError):
        pass
    conn = Connection(fd)
    path, factory, args = conn.recv()
    sys.path[:] = path
    try:
        handler = _resolve(factory)(*args)
    except BaseException as e:  # noqa: BLE001 - every load failure is reported to the parent
        conn.send({"ok": False, "kind": type(e).__name__, "message": str(e) or type(e).__name__})
        return
    conn.send({"ok": True})
    while True:
        try:
            header = conn.recv()
        except EOFError:
            return
        if header is None:
            return
        payload = bytearray(header["nbytes"])
        conn.recv_bytes_into(payload)
        t0 = time.perf_counter()
        try:
            reply, data = handler(header, payload)
        except BaseException as e:  # noqa: BLE001 - a raising subject is a result, not a crash
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
            reply, data = {"status": "raised", "message": f"{type(e).__name__}: {e}{where}"}, b""
        reply.setdefault("seconds", time.perf_counter() - t0)
        reply["nbytes"] = memoryview(data).nbytes
        del payload
        conn.send(reply)
        conn.send_bytes(data)


def _death(code: Optional[int]) -> str:
    if code is None:
        return "the child process stopped answering"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Isolated:
    """A subject living in a child process. Use as a context manager; `call` never raises for the
    subject's faults (only LoadFailed when a fresh child cannot even build its handler)."""

    def __init__(self, factory: str, args: tuple = (), *, call_timeout: float = 120.0,
                 load_timeout: float = 300.0):
        self.factory, self.args = factory, args
        self.call_timeout, self.load_timeout = call_timeout, load_timeout
        self._proc: Any = None
        self._conn: Any = None
        self.restarts = 0

    def __enter__(self) -> "Isolated":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the child and wait for its handler. Raises LoadFailed (also on a load crash/hang)."""
        if self._conn is not None:
            self._conn.close()
        ours, theirs = socket.socketpair()
        code = f"from llmdoctor.subjects.isolation import _child; _child({theirs.fileno()})"
        proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                stdin=subprocess.DEVNULL, stdout=2)  # stdout -> our stderr
        theirs.close()  # so that the child's death reads as EOF here
        parent = Connection(ours.detach())
        self._proc, self._conn = proc, parent
        try:
            parent.send((sys.path, self.factory, self.args))
            if not parent.poll(self.load_timeout):
                self._kill()
                raise LoadFailed("TimeoutError", f"loading took longer than {self.load_timeout:.0f} s")
            reply = parent.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._reap()
            raise LoadFailed("Crash", f"the child {_death(code)} while loading") from None
        if not reply["ok"]:
            self._reap()
            raise LoadFailed(reply["kind"], reply["message"])

    def call(self, header: dict[str, Any], payload: Any) -> Outcome:
        if self._proc is None:
            self.restarts += self._conn is not None  # a fresh child after a crash or hang
            self.start()
        conn = self._conn
        t0 = time.perf_counter()
        try:
            conn.send({**header, "nbytes": memoryview(payload).nbytes})
            conn.send_bytes(payload)
            if not conn.poll(self.call_timeout):
                self._kill()
                return Outcome("timeout", f"no answer within {self.call_timeout:g} s (hang?)",
                               seconds=time.perf_counter() - t0)
            reply = conn.recv()
            data = bytearray(reply["nbytes"])  # writable: the caller may wrap it without a copy
            conn.recv_bytes_into(data)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            code = self._reap()
            return Outcome("crashed", _death(code), seconds=time.perf_counter() - t0)
        status = reply.get("status", "ok")
        return Outcome(status, reply.get("message", ""), reply, data, time.perf_counter() - t0)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self._reap()

    def _reap(self) -> Optional[int]:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        try:
            return proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._conn.send(None)
                self._proc.wait(5)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
            self._kill()
        if self._conn is not None:
            self._conn.close()
