"""Where a diagnosis spends its time, by stage (read, decode, reference, engine, judging).

    with Stages() as st:                  # active in this thread (a ContextVar) until the block ends
        with stage("reference"):          # nested stages are exclusive: the outer one loses the inner's time
            with stage("decode"): ...
    st.seconds                            # {"reference": ..., "decode": ...}

`stage` is a no-op where no Stages is active (a plain reference run, or another thread). Time on CUDA is
made honest by synchronizing the device at each boundary (kernels are queued, not run, when a call
returns); that costs a few microseconds a boundary and only once CUDA is in use.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator

import torch

_ACTIVE: ContextVar["Stages | None"] = ContextVar("llmdoctor_stages", default=None)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Stages:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open stage: the time its nested stages took
        self._token = None

    def __enter__(self) -> "Stages":
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._token)

    @contextmanager
    def measure(self, name: str) -> Iterator[None]:
        _sync()
        t0 = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            _sync()
            elapsed = time.perf_counter() - t0
            inner = self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
            if self._inner:
                self._inner[-1] += elapsed


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Count the block's time (less its nested stages') to `name` in the active Stages, if any."""
    st = _ACTIVE.get()
    if st is None:
        yield
        return
    with st.measure(name):
        yield
