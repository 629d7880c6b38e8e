"""`llmdoctor verify`: every block of every tensor decoded once (no sampling), at the disk's speed.

One pass over the file, tensor by tensor in file order (shard by shard for a split model):
- CPU: the bytes are read through the file mapping, with MADV_WILLNEED read-ahead advice a window
  ahead of the decoder (so the disk works while the cores decode); each tensor is decoded by the
  native kernels (all cores, `dequant.py`) chunk by chunk into one output buffer reused for every
  tensor, and each chunk is checked while it is still in the cache.
- CUDA: a reader thread fills pinned host buffers (two: while one is copied to the GPU and decoded by
  the Triton kernels, the next one is read: double buffering), the checks run on the GPU.

Per chunk: its sum (finite <=> every value finite, but for an overflow, which the exact test then
settles); only a chunk that holds a non-finite value is searched for its first bad block,
whose file offset (in the shard that holds it) is reported. The forensics module's statistics
(`checks/forensics.py`: its streaming `Accumulator`) are fed the same chunk, raw blocks and decoded
values, and its sibling comparison runs at the end: its findings are verify's too, and its per-tensor
statistics (rms, mean, max |w|, kurtosis, block scales) are verify's per-tensor report.

Threads: the decode uses every core (the native kernels' C pool); the checks and the statistics run
torch single-threaded on this thread: torch's intra-op threads, each op waiting for all of them, were
20-60x slower on this 2-core machine when other processes kept it busy (1M-value sum: 18 ms on 2
threads at load average 10, 0.12 ms on 1).
Integer tensors (I8..I64) have no non-finite values by type: reported as such, not decoded. Tensors
of a big-endian file are skipped with that reason (the decoders read little-endian blocks).
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ..errors import InputError
from ..gguf import open_gguf
from ..gguf.reader import GGUFFile, TensorInfo
from .base import Finding

CHECK = "verify"
# Output values decoded per chunk, into one buffer reused for every chunk: 1M float32 (4 MiB) stays in
# the L2/L3 cache between the kernel writing it and the checks reading it, and amortizes the ~10 us of
# Python per chunk over ~1 ms of work.
CHUNK_VALUES = 1 << 20
# Read-ahead: advise the next READ_AHEAD bytes each time the decoder passes ADVISE_STEP bytes.
READ_AHEAD = 128 << 20
ADVISE_STEP = 32 << 20
# CUDA: bytes of raw blocks per pinned buffer (two of them).
CUDA_BUFFER = 64 << 20
_INTEGER = {QT.I8, QT.I16, QT.I32, QT.I64}

Progress = Callable[[int, int, str], None]  # (bytes done so far, bytes in all, tensor name)


@dataclass
class TensorReport:
    name: str
    type: str
    shard: str
    offset: int
    nbytes: int
    values: int = 0
    non_finite: int = 0
    first_bad_block: int | None = None
    first_bad_offset: int | None = None  # file offset (in `shard`) of the first bad block
    stats: dict[str, Any] | None = None  # the forensics module's: rms, mean, max_abs, kurtosis, block scales
    skipped: str = ""  # why the tensor was not decoded

    def finding(self) -> Finding:
        m = {k: v for k, v in self.__dict__.items() if k != "name"}
        if self.skipped:
            return Finding(CHECK, "gguf", self.name, "skip", reason=f"skipped: {self.skipped}", metrics=m)
        if self.type in {q.name for q in _INTEGER}:
            return Finding(CHECK, "gguf", self.name, "pass", metrics=m,
                           explanation=f"{self.type}: integers, finite by type")
        if self.non_finite:
            return Finding(CHECK, "gguf", self.name, "fail", metrics=m, confidence="high",
                           explanation=f"{self.non_finite} of {self.values} values are inf/NaN; first bad block "
                                       f"{self.first_bad_block} at offset {self.first_bad_offset} of "
                                       f"{Path(self.shard).name}")
        st = self.stats or {}
        more = f", rms {st['rms']:.4g}, max |w| {st['max_abs']:.4g}" if "rms" in st else ""
        return Finding(CHECK, "gguf", self.name, "pass", metrics=m, explanation=f"{self.values} values finite{more}")


@dataclass
class Result:
    findings: list[Finding]
    tensors: list[TensorReport]
    bytes: int
    seconds: float
    device: str
    shards: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def totals(self) -> dict[str, Any]:
        return {"tensors": len(self.tensors), "bytes": self.bytes, "values": sum(t.values for t in self.tensors),
                "non_finite": sum(t.non_finite for t in self.tensors),
                "bad_tensors": sum(1 for t in self.tensors if t.non_finite), "seconds": self.seconds,
                "gb_per_s": self.gb_per_s, "device": self.device, "shards": self.shards}


def _forensics() -> Any:
    """The forensics module (issue 14's), or None where it is not installed."""
    try:
        from . import forensics
    except ImportError:
        return None
    return forensics


class _Stats:
    """One tensor's forensic accumulator (or nothing without the module)."""

    def __init__(self, fx: Any, t: TensorInfo):
        self.acc = None if fx is None else fx.Accumulator(t.name, t.type)

    def add(self, raw: np.ndarray, type_size: int, v: torch.Tensor) -> None:
        if self.acc is not None:
            self.acc.add(raw.reshape(-1, type_size) if self.acc.fields else None, v)

    def finish(self, rep: TensorReport, into: list) -> None:
        if self.acc is not None:
            st = self.acc.finish()
            rep.stats = {k: v for k, v in st.as_dict().items() if k in ("rms", "mean", "max_abs", "kurtosis", "scales")}
            into.append(st)


class _Pipeline:
    """The forensic statistics on their own thread, one chunk behind the decoder: the decoder fills one
    of two output buffers while this thread reads the other, so the statistics (about the decode's
    work with forensics' C passes, bench/RESULTS.md; several times it with its torch fallback) and the
    decode share the cores instead of taking turns. Chunks of a tensor reach the
    statistics in file order (one thread, one queue). Without the forensics module: no thread."""

    def __init__(self, fx: Any, n_values: int):
        self.bufs = [torch.empty(n_values, dtype=torch.float32) for _ in range(2)]  # reused for every chunk
        self.free = [threading.Semaphore(1) for _ in self.bufs]
        self.stats: list[Any] = []
        self.error: BaseException | None = None
        self.q: queue.Queue = queue.Queue()
        self.thread = None
        if fx is not None:
            self.thread = threading.Thread(target=self._work, daemon=True, name="verify-stats")
            self.thread.start()
        self.k = 0

    def buffer(self) -> tuple[int, torch.Tensor]:
        """The next output buffer, once the statistics are done with it."""
        i = self.k % 2
        self.k += 1
        self.free[i].acquire()
        if self.error is not None:
            raise self.error
        return i, self.bufs[i]

    def add(self, stats: "_Stats", raw: np.ndarray, type_size: int, i: int, v: torch.Tensor) -> None:
        if self.thread is None:
            self.free[i].release()
        else:
            self.q.put((stats, raw, type_size, i, v))

    def finish(self, stats: "_Stats", rep: TensorReport) -> None:
        if self.thread is not None:
            self.q.put((stats, rep))

    def _work(self) -> None:
        torch.set_num_threads(1)
        with torch.inference_mode():
            while (item := self.q.get()) is not None:
                try:
                    if len(item) == 2:
                        item[0].finish(item[1], self.stats)
                    elif self.error is None:
                        item[0].add(item[1], item[2], item[4])
                except BaseException as e:  # handed to the decoder thread, which raises it
                    self.error = e
                finally:
                    if len(item) == 5:
                        self.free[item[3]].release()

    def close(self) -> list[Any]:
        if self.thread is not None:
            self.q.put(None)
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.stats


class _Threads:
    """torch on `n` threads for the decode, on one for everything else (see the module docstring)."""

    def __init__(self) -> None:
        self.n = torch.get_num_threads()

    def __enter__(self) -> "_Threads":
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.n)

    def decode(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        torch.set_num_threads(self.n)
        try:
            return fn(*args, **kw)
        finally:
            torch.set_num_threads(1)


# ---- the checks on one decoded chunk (any device) ---------------------------------------------------

def _check_chunk(rep: TensorReport, v: torch.Tensor, first_block: int, block_size: int, type_size: int) -> None:
    """v: float32 [n_blocks * block_size] decoded values of the blocks from `first_block` on.

    The sum is finite exactly when every value is, except when finite values overflow it (|values|
    near 1e38 / n): only a non-finite sum pays for the elementwise test, which decides.
    """
    if not math.isfinite(float(v.sum())):
        ok = torch.isfinite(v)
        bad = int(ok.numel() - ok.sum())
        if bad and rep.first_bad_block is None:
            blk = int((~ok.view(-1, block_size).all(1)).nonzero()[0, 0]) + first_block
            rep.first_bad_block, rep.first_bad_offset = blk, rep.offset + blk * type_size
        rep.non_finite += bad
    rep.values += v.numel()


def _report(t: TensorInfo) -> TensorReport:
    """The tensor's report before decoding; integer tensors and those that are not decoded are final."""
    rep = TensorReport(t.name, t.type.name, t.path, t.offset, t.nbytes)
    if t.file.byte_order != "<" and t.type not in _INTEGER:
        rep.skipped = "a big-endian file: the decoders read little-endian blocks"
    elif t.type in _INTEGER:
        rep.values = t.n_elements
    return rep


def _decoded(t: TensorInfo) -> bool:
    return t.type not in _INTEGER and t.file.byte_order == "<"


# ---- CPU -------------------------------------------------------------------------------------------

class _ReadAhead:
    """MADV_WILLNEED the next READ_AHEAD bytes of a shard each time the decoder has moved ADVISE_STEP."""

    def __init__(self, shard: GGUFFile):
        self.shard, self.advised, self.last = shard, 0, -ADVISE_STEP
        shard.advise(0, shard.file_size, mmap.MADV_SEQUENTIAL)

    def at(self, pos: int) -> None:
        if pos - self.last >= ADVISE_STEP:
            self.last = pos
            end = min(pos + READ_AHEAD, self.shard.file_size)
            if end > self.advised:
                start = max(pos, self.advised)
                self.shard.advise(start, end - start)
                self.advised = end


def _decode_cpu(t: TensorInfo, pipe: _Pipeline, ahead: _ReadAhead, done: int, progress: Callable,
                stats: _Stats, threads: _Threads) -> TensorReport:
    """Decode t chunk by chunk into the pipeline's reused buffers, checking each chunk while it is in
    cache, then handing it to the statistics thread."""
    from ..gguf.dequant import dequantize

    rep = _report(t)
    bs, ts = t.block_size, t.type_size
    raw = t.data
    step = max(1, CHUNK_VALUES // bs)
    for b0 in range(0, t.n_blocks, step):
        b1 = min(b0 + step, t.n_blocks)
        ahead.at(t.offset + b1 * ts)
        i, out = pipe.buffer()
        v = out[: (b1 - b0) * bs]
        threads.decode(dequantize, raw[b0 * ts : b1 * ts], t.type, (b1 - b0, bs), out=v.view(b1 - b0, bs))
        _check_chunk(rep, v, b0, bs, ts)
        pipe.add(stats, raw[b0 * ts : b1 * ts], ts, i, v)
        progress(done + b1 * ts, t.name)
    pipe.finish(stats, rep)
    return rep


def _tensors_in_file_order(g: GGUFFile, names: Collection[str] | None = None) -> Iterator[tuple[GGUFFile, TensorInfo]]:
    for s in g.shards:
        for t in sorted(s.file_tensors, key=lambda t: t.offset):
            if names is None or t.name in names:
                yield s, t


def _run_cpu(g: GGUFFile, progress: Callable, fx: Any, names: Collection[str] | None = None
             ) -> tuple[list[TensorReport], list[Any]]:
    reports, done, ahead = [], 0, None
    pipe = _Pipeline(fx, CHUNK_VALUES)
    try:
        with _Threads() as threads:
            for s, t in _tensors_in_file_order(g, names):
                if ahead is None or ahead.shard is not s:
                    ahead = _ReadAhead(s)
                rep = _decode_cpu(t, pipe, ahead, done, progress, _Stats(fx, t), threads) if _decoded(t) else _report(t)
                reports.append(rep)
                done += t.nbytes
                progress(done, t.name)
    finally:
        stats = pipe.close()
    return reports, stats


# ---- CUDA ------------------------------------------------------------------------------------------

def _chunks(g: GGUFFile, limit: int, names: Collection[str] | None = None) -> Iterator[tuple[TensorInfo, int, int]]:
    """(tensor, first block, end block) pieces of at most `limit` bytes, in file order."""
    for _, t in _tensors_in_file_order(g, names):
        if not _decoded(t):
            yield t, 0, 0
            continue
        step = max(1, limit // t.type_size)
        for b0 in range(0, t.n_blocks, step):
            yield t, b0, min(b0 + step, t.n_blocks)


def _reader(g: GGUFFile, bufs: list[torch.Tensor], free: queue.Queue, full: queue.Queue, stop: threading.Event,
            names: Collection[str] | None = None) -> None:
    """Fill free pinned buffers with the next chunk's bytes (one large pread each); None ends."""
    fds: dict[str, int] = {}
    try:
        for t, b0, b1 in _chunks(g, bufs[0].numel(), names):
            i = free.get()
            if stop.is_set():
                return
            n = (b1 - b0) * t.type_size
            if n:
                fd = fds.get(t.path)
                if fd is None:
                    fd = fds[t.path] = os.open(t.path, os.O_RDONLY)
                view = memoryview(bufs[i].numpy())[:n]
                got = os.preadv(fd, [view], t.offset + b0 * t.type_size)
                if got != n:
                    raise OSError(f"{t.path}: short read of {got} of {n} bytes at {t.offset + b0 * t.type_size}")
            full.put((i, t, b0, b1))
        full.put(None)
    except BaseException as e:  # handed to the consumer, which raises it
        full.put(e)
    finally:
        for fd in fds.values():
            os.close(fd)


def _run_cuda(g: GGUFFile, progress: Callable, fx: Any, names: Collection[str] | None = None
              ) -> tuple[list[TensorReport], list[Any]]:
    """Double buffering: the reader thread fills one pinned buffer while the other is copied (on its
    own stream) and decoded by the Triton kernels; a buffer goes back to the reader once its copy is done."""
    from ..gguf.dequant import dequantize

    dev = torch.device("cuda")
    bufs = [torch.empty(CUDA_BUFFER, dtype=torch.uint8).pin_memory() for _ in range(2)]
    dev_raw = [torch.empty(CUDA_BUFFER, dtype=torch.uint8, device=dev) for _ in range(2)]
    copied = [torch.cuda.Event() for _ in range(2)]
    per_byte = max((t.block_size / t.type_size for t in g.tensors if _decoded(t)), default=0)
    out = torch.empty(math.ceil(CUDA_BUFFER * per_byte), dtype=torch.float32, device=dev)  # any chunk's values
    copy_stream = torch.cuda.Stream()
    free: queue.Queue = queue.Queue()
    full: queue.Queue = queue.Queue()
    for i in range(2):
        free.put(i)
    stop = threading.Event()
    th = threading.Thread(target=_reader, args=(g, bufs, free, full, stop, names), daemon=True, name="verify-read")
    th.start()
    reports, stats, done = [], [], 0
    cur: tuple[TensorInfo, TensorReport, _Stats] | None = None

    def finish() -> None:
        t, rep, acc = cur
        reports.append(rep)
        if _decoded(t):
            acc.finish(rep, stats)

    try:
        while (item := full.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            i, t, b0, b1 = item
            if cur is None or cur[0] is not t:
                if cur is not None:
                    finish()
                cur = (t, _report(t), _Stats(fx, t))
            if b1 > b0:
                n = (b1 - b0) * t.type_size
                with torch.cuda.stream(copy_stream):
                    dev_raw[i][:n].copy_(bufs[i][:n], non_blocking=True)
                    copied[i].record(copy_stream)
                torch.cuda.current_stream().wait_event(copied[i])
                bs = t.block_size
                v = out[: (b1 - b0) * bs]
                dequantize(dev_raw[i][:n], t.type, (b1 - b0, bs), out=v.view(b1 - b0, bs))
                _check_chunk(cur[1], v, b0, bs, t.type_size)
                cur[2].add(bufs[i][:n].numpy(), t.type_size, v)
                copied[i].synchronize()
                done += n
            free.put(i)
            progress(done, t.name)
        if cur is not None:
            finish()
    finally:
        stop.set()
        free.put(0)  # wakes a reader waiting for a buffer
        th.join()
    return reports, stats


# ---- entry point -------------------------------------------------------------------------------------

def run(path: Path, *, device: str = "cpu", progress: Progress = lambda done, total, name: None,
        manifest: Path | None = None, tensors: Collection[str] | None = None,
        combine: Callable[[list, list], tuple[list, list] | None] | None = None) -> Result | None:
    """Verify every tensor of the model at `path` (any shard of a split set) on `device`.

    Spread over ranks (checks/verify_ranks.py): `tensors` restricts the pass to a rank's share, and
    `combine(reports, stats)` gathers every rank's before the findings are built, returning them all
    on the rank that reports and None on the others (run then returns None)."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    fx = _forensics()
    with open_gguf(path) as g:
        total = sum(t.nbytes for t in g.tensors)
        shards = [s.path for s in g.shards]
        if device == "cuda" and not torch.cuda.is_available():
            f = Finding(CHECK, "cuda", "all", "skip", reason="skipped: --device cuda, but CUDA is not available")
            return Result([f], [], total, 0.0, device, shards)
        t0 = time.perf_counter()
        with torch.inference_mode():
            step = lambda done, name: progress(done, total, name)  # noqa: E731
            reports, stats = (_run_cuda if device == "cuda" else _run_cpu)(g, step, fx, tensors)
        if combine is not None:
            joined = combine(reports, stats)
            if joined is None:
                return None
            reports, stats = joined
        seconds = time.perf_counter() - t0
        findings = [r.finding() for r in reports]
        if fx is None:
            findings.append(Finding(CHECK, "forensics", "all", "skip",
                                    reason="skipped: the forensics module (checks/forensics.py) is not available"))
        else:
            findings += fx.compare(stats, file=g.path)
        if manifest is not None:
            from .manifest import compare

            findings += compare(g, manifest)
    return Result(findings, reports, total, seconds, device, shards)
