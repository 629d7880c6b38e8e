"""Run a subject in a child process with a timeout: a crash, hang or exception becomes a result.

One long-lived child per subject (a fresh interpreter: no inherited CUDA state, locks or mmaps, and,
unlike multiprocessing's 'spawn', no re-import of the caller's __main__) loads the subject once
through a handler factory ("module:function", called with `args` in the child) and then serves
requests one by one over a socket pair (multiprocessing.connection framing):

    request  = (header: dict, payload: bytes)   payload received into a fresh private bytearray
    reply    = handler(header, payload) -> (header: dict, payload: bytes-like)

Bulk bytes cross through a shared file both processes map (an unlinked file in /dev/shm, reached by
the child as /proc/<parent>/fd/<fd>: one memcpy each way instead of a socket's buffered copies; the
socket is the fallback; no benchmark of the two is recorded). The child copies the request payload into a fresh
bytearray, so the subject only ever sees its own writable copy of the bytes, never a view of the
parent's read-only mmap (../shared/DESIGN.md, "Subjects are isolated").
If the child dies (segfault, abort, CUDA illegal address) or a call exceeds its timeout, the call's
`Outcome` says so and the next call starts a fresh child. The child's stdout is redirected to stderr
so that a chatty subject cannot corrupt `--json` output.
"""

from __future__ import annotations

import importlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from ..outcomes import LoadFailed, Outcome


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
    try:  # Linux: die with the parent, so a hung subject never outlives a killed check
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    conn = Connection(fd)
    path, factory, args, bulk_path = conn.recv()
    sys.path[:] = path
    try:
        bulk = _ChildBulk(bulk_path) if bulk_path else None
    except OSError:
        bulk = None
    try:
        handler = _resolve(factory)(*args)
    except BaseException as e:  # every load failure is reported to the parent
        conn.send({"ok": False, "kind": type(e).__name__, "message": str(e) or type(e).__name__})
        return
    conn.send({"ok": True, "bulk": bulk is not None})
    while True:
        try:
            header = conn.recv()
        except EOFError:
            return
        if header is None:
            return
        if "bulk_size" in header:
            payload = bytearray(bulk.view(header["bulk_size"])[: header["nbytes"]])  # the private copy
        else:
            payload = bytearray(header["nbytes"])
            conn.recv_bytes_into(payload)
        t0 = time.perf_counter()
        try:
            reply, data = handler(header, payload)
        except BaseException as e:  # a raising subject is a result, not a crash
            tb = traceback.extract_tb(e.__traceback__)
            where = f" at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno}" if tb else ""
            reply, data = {"status": "raised", "message": f"{type(e).__name__}: {e}{where}"}, b""
        reply.setdefault("seconds", time.perf_counter() - t0)
        out = memoryview(data).cast("B")
        reply["nbytes"] = out.nbytes
        del payload
        if "bulk_size" in header and out.nbytes <= header["bulk_size"]:
            bulk.view(header["bulk_size"])[: out.nbytes] = out
            reply["in_bulk"] = True
            conn.send(reply)
        else:
            conn.send(reply)
            conn.send_bytes(out)


class _ChildBulk:
    """The child's mapping of the parent's shared file, remapped when the parent grows it."""

    def __init__(self, path: str):
        self.file = open(path, "r+b")
        self.size, self.mm = 0, None

    def view(self, size: int) -> memoryview:
        if size != self.size:
            if self.mm is not None:
                self.mm.close()
            self.mm, self.size = mmap.mmap(self.file.fileno(), size), size
        return memoryview(self.mm)


class _Bulk:
    """The parent's growable shared file (unlinked at once: nothing is left behind after a kill)."""

    def __init__(self) -> None:
        fd, name = tempfile.mkstemp(prefix="llmdoctor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        os.unlink(name)
        self.fd, self.size, self.mm = fd, 0, None
        self.path = f"/proc/{os.getpid()}/fd/{fd}"
        self.reserve(1 << 20)

    def reserve(self, n: int) -> memoryview:
        if n > self.size:
            size = max(n, 2 * self.size)
            os.ftruncate(self.fd, size)
            if self.mm is not None:
                self.mm.close()
            self.mm, self.size = mmap.mmap(self.fd, size), size
        return memoryview(self.mm)

    def close(self) -> None:
        if self.mm is not None:
            self.mm.close()
        os.close(self.fd)


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
        self._bulk: Optional[_Bulk] = None
        self._bulk_ok = False
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
        if self._bulk is None and os.path.isdir(f"/proc/{os.getpid()}/fd"):
            try:
                self._bulk = _Bulk()
            except OSError:
                pass
        try:
            parent.send((sys.path, self.factory, self.args, self._bulk.path if self._bulk else None))
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
        self._bulk_ok = reply["bulk"]

    def call(self, header: dict[str, Any], payload: Any, reply_hint: int = 0) -> Outcome:
        """Send one request; `reply_hint` (bytes) sizes the shared file for the reply as well."""
        if self._proc is None:
            self.restarts += self._conn is not None  # a fresh child after a crash or hang
            self.start()
        conn = self._conn
        t0 = time.perf_counter()
        src = memoryview(payload).cast("B")
        try:
            if self._bulk_ok:
                view = self._bulk.reserve(max(src.nbytes, reply_hint))
                view[: src.nbytes] = src
                conn.send({**header, "nbytes": src.nbytes, "bulk_size": self._bulk.size})
            else:
                conn.send({**header, "nbytes": src.nbytes})
                conn.send_bytes(src)
            if not conn.poll(self.call_timeout):
                self._kill()
                return Outcome("timeout", f"no answer within {self.call_timeout:g} s (hang?)",
                               seconds=time.perf_counter() - t0)
            reply = conn.recv()
            if reply.get("in_bulk"):
                data = bytearray(memoryview(self._bulk.mm)[: reply["nbytes"]])
            else:
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
                self._proc.wait(0.2)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
            self._kill()  # a subject has nothing to flush: do not wait for its interpreter's teardown
        if self._conn is not None:
            self._conn.close()
        if self._bulk is not None:
            self._bulk.close()
            self._bulk = None
