"""`llmdoctor verify`: every block of every tensor decoded once (no sampling), at the disk's speed.

One pass over the file, tensor by tensor in file order (shard by shard for a split model), in three
parts that run at once:
- reading: reader threads pread the file's chunks, in file order, into a ring of reusable buffers
  (at most 1 GiB, and 4 chunks per worker; pinned host memory for CUDA). The file mapping is not touched, so the process holds
  the ring and nothing of the file however large it is (a mapped page, once touched, stays in the
  process's resident set until unmapped: 31.9 GB max RSS for a 32 GB file, issue 23); the page cache
  is the kernel's and is not the process's memory.
- work on worker threads (one per core), chunk by chunk: any worker takes any chunk (the least busy
  one), so that one large tensor is spread over every core. CPU: the worker decodes the chunk (the
  native kernels, one thread each) CHUNK_VALUES values at a time into its own buffer, checks each
  piece while it is in the cache and feeds it to the chunk's own forensics accumulator; where the
  native libraries are built that is one C call for the whole chunk (forensics' add_decoded), since a
  worker that crosses the GIL several times per piece is what bounded the pass: on 16 cores it ran
  on ~4 and slowed down with more workers (bench/verify_workers.py on the H200); CUDA: the
  worker gathers the raw blocks' statistics (block scales, sub-block codes) on the host. The chunks'
  statistics are joined in file order (forensics' Accumulator.merge keeps one entry per piece and
  folds them in order), so the numbers are those of one sequential pass whichever worker did which
  chunk. With a manifest asked for, the tensor's own worker feeds its chunks to its sha256 in file
  order (hashlib releases the GIL), so that one read gives integrity, forensics and a manifest.
- CUDA: this thread copies each chunk to the GPU (its own stream), decodes it with the Triton kernels,
  checks it and gathers the decoded values' statistics there.

Per piece: its sum (finite <=> every value finite, but for an overflow, which the exact test then
settles); only a piece that holds a non-finite value is searched for its first bad block,
whose file offset (in the shard that holds it) is reported. The forensics module's statistics
(`checks/file/tensor_stats.py`: its streaming `Accumulator`) are fed the same piece, raw blocks and decoded
values, and its sibling comparison runs at the end: its findings are verify's too, and its per-tensor
statistics (rms, mean, max |w|, kurtosis, block scales) are verify's per-tensor report.

Threads: torch runs single-threaded during the pass (each worker is one core's worth of work):
torch's intra-op threads, each op waiting for all of them, were 20-60x slower on a 2-core machine
when other processes kept it busy (1M-value sum: 18 ms on 2 threads at load average 10, 0.12 ms on 1).
What bounds the pass where the reading does not: the cores' decoding, and with a manifest one
tensor's sha256, which is sequential (one core's hashing rate per tensor, ~1-2 GB/s).
Integer tensors (I8..I64) have no non-finite values by type: reported as such, not decoded. Tensors
of a big-endian file are skipped with that reason (the decoders read little-endian blocks).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from ...errors import InputError
from ...gguf import open_gguf
from ...gguf.dequant import dequantize
from ...gguf.reader import GGUFFile, TensorInfo
from ..base import Finding
from . import forensics
from .forensics_native import native_decoding
from .tensor_stats import Accumulator

CHECK = "verify"
# Output values decoded per piece, into one buffer per worker reused for every piece: 1M float32
# (4 MiB) stays in the L2/L3 cache between the kernel writing it and the checks reading it, and
# amortizes the ~10 us of Python per piece over ~1 ms of work.
CHUNK_VALUES = 1 << 20
# Bytes per read (one chunk of the ring), and the ring's size: a few tensors of a few hundred MB in
# flight at once, so that the workers have different tensors to work on.
READ_BYTES = {"cpu": 32 << 20, "cuda": 64 << 20}
RING_BYTES = 1 << 30
RING_PER_WORKER = 4  # chunks at most: enough for every worker to have work queued while the readers refill
READERS = 4  # reader threads at most: one 32 MiB pread from the page cache is ~5 ms of one core's copying
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
    sha256: str | None = None  # of the bytes as stored, where the pass was asked for a manifest

    def finding(self) -> Finding:
        m = {k: v for k, v in self.__dict__.items() if k != "name"}
        if self.skipped:
            return Finding(CHECK, "gguf", self.name, "skip", reason=f"skipped: {self.skipped}", metrics=m)
        if self.type in {q.name for q in _INTEGER}:
            return Finding(CHECK, "gguf", self.name, "pass", metrics=m,
                           explanation=f"{self.type}: integers, finite by type")
        if self.non_finite:
            return Finding(CHECK, "gguf", self.name, "fail", metrics=m, confidence="high",
                           explanation=f"the tensor holds inf/NaN values: {self.non_finite} of {self.values}; first bad block "
                                       f"{self.first_bad_block} at offset {self.first_bad_offset} of "
                                       f"{Path(self.shard).name}")
        st = self.stats or {}
        more = f", rms {st['rms']:.4g}, max |w| {st['max_abs']:.4g}" if "rms" in st else ""
        return Finding(CHECK, "gguf", self.name, "pass", metrics=m,
                       explanation=f"every value finite ({self.values} values{more})")


@dataclass
class Result:
    findings: list[Finding]
    tensors: list[TensorReport]
    bytes: int
    seconds: float
    device: str
    shards: list[str] = field(default_factory=list)
    manifest: dict[str, Any] | None = None  # checks/file/manifest.py's document, from this pass's hashes

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else math.inf

    def totals(self) -> dict[str, Any]:
        return {"tensors": len(self.tensors), "bytes": self.bytes, "values": sum(t.values for t in self.tensors),
                "non_finite": sum(t.non_finite for t in self.tensors),
                "bad_tensors": sum(1 for t in self.tensors if t.non_finite), "seconds": self.seconds,
                "gb_per_s": self.gb_per_s, "device": self.device, "shards": self.shards}


class _Part:
    """The statistics of one chunk of a tensor, gathered by whichever worker decoded it: its report's
    counts (None where the dispatching thread checks the values: CUDA) and a forensic accumulator."""

    def __init__(self, tw: "_Tensor", checks: bool):
        self.rep = _report(tw.t) if checks else None
        self.acc = Accumulator(tw.t.name, tw.t.type) if tw.decoded else None


class _Tensor:
    """One tensor's pass. Its chunks are decoded on any worker, each into a _Part of its own; the parts
    are joined into the tensor's report and accumulator in file order as they complete, so that the
    statistics are those of one sequential pass over the pieces whichever threads did the work. Its
    sha256 (where asked) is fed in file order by the one worker that owns the tensor. CUDA: the
    dispatching thread checks the decoded values into the report and feeds `gpu_acc` (the values'
    half); the parts then carry the raw blocks' half. finish() runs when the last of the tensor's
    `tasks` is done, on the thread that did it."""

    def __init__(self, t: TensorInfo, hashing: bool, tasks: int, gpu: bool):
        self.t, self.rep = t, _report(t)
        self.decoded = _decoded(t)
        self.acc = Accumulator(t.name, t.type) if self.decoded else None  # the parts joined so far
        self.gpu_acc = Accumulator(t.name, t.type) if self.decoded and gpu else None
        self.sha = hashlib.sha256() if hashing else None
        self.stats: Any = None  # tensor_stats.TensorStats once finished
        self.lock = threading.Lock()
        self.left, self.skipped = tasks, False
        self.parts: dict[int, _Part] = {}  # done, waiting for the parts before them
        self.joined = 0  # parts joined: chunks 0 .. joined - 1

    def done(self, j: int | None, part: _Part | None, skip: bool) -> None:
        """One task finished: chunk j's part (None: a task without one); the last one finishes the tensor."""
        with self.lock:
            self.skipped = self.skipped or skip
            if part is not None:
                self.parts[j] = part  # type: ignore[index]
                while self.joined in self.parts:
                    self._join(self.parts.pop(self.joined))
                    self.joined += 1
            self.left -= 1
            last = self.left == 0
        if last and not self.skipped:
            self.finish()

    def _join(self, p: _Part) -> None:
        if p.rep is not None:
            self.rep.values += p.rep.values
            self.rep.non_finite += p.rep.non_finite
            if self.rep.first_bad_block is None and p.rep.first_bad_block is not None:
                self.rep.first_bad_block, self.rep.first_bad_offset = p.rep.first_bad_block, p.rep.first_bad_offset
        if p.acc is not None and self.acc is not None:
            self.acc.merge(p.acc)

    def finish(self) -> None:
        if self.acc is not None:
            if self.gpu_acc is not None:
                self.acc.merge(self.gpu_acc)
            self.stats = self.acc.finish()
            keep = ("rms", "mean", "max_abs", "kurtosis", "scales")
            self.rep.stats = {k: v for k, v in self.stats.as_dict().items() if k in keep}
        if self.sha is not None:
            self.rep.sha256 = self.sha.hexdigest()


# ---- the checks on one decoded piece (any device) ---------------------------------------------------

def _check_chunk(rep: TensorReport, v: torch.Tensor, first_block: int, block_size: int, type_size: int,
                 finite: bool | None = None) -> None:
    """v: float32 [n_blocks * block_size] decoded values of the blocks from `first_block` on; `finite`:
    whether every value is, where the forensics scan of the same values has said so already.

    Without it, the sum: finite exactly when every value is, except when finite values overflow it
    (|values| near 1e38 / n). Only a piece that is not finite pays for the elementwise test, which decides.
    """
    if finite is None:
        finite = math.isfinite(float(v.sum()))
    if not finite:
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


# ---- reading: the file's chunks, in order, into a ring of reused buffers ----------------------------

def _tensors_in_file_order(g: GGUFFile, names: Collection[str] | None = None) -> Iterator[TensorInfo]:
    for s in g.shards:
        for t in sorted(s.file_tensors, key=lambda t: t.offset):
            if names is None or t.name in names:
                yield t


def _chunks(tensors: list[TensorInfo], limit: int, every: bool) -> Iterator[tuple[TensorInfo, int, int]]:
    """(tensor, first block, end block) pieces of at most `limit` bytes (at least one CHUNK_VALUES
    piece), each a whole number of CHUNK_VALUES pieces, so that the pieces a worker decodes start
    where one sequential pass's would; (t, 0, 0) for a tensor that is not read (not decoded, and no
    hash asked for: `every` False)."""
    for t in tensors:
        if not (every or _decoded(t)) or t.n_blocks == 0:
            yield t, 0, 0
            continue
        unit = _piece_blocks(t)
        step = max(unit, limit // t.type_size // unit * unit)
        for b0 in range(0, t.n_blocks, step):
            yield t, b0, min(b0 + step, t.n_blocks)


class _Ring:
    """The chunks, in order, read by up to READERS threads (os.preadv, ahead of the consumers by up to
    the ring's size) into reusable byte buffers. Iterating yields (buffer index or None, tensor, b0, b1)
    with the buffer held once; hold() adds a holder, release() drops one, and a buffer goes back to
    the readers when its last holder has released it."""

    def __init__(self, bufs: list[np.ndarray], chunks: Iterator[tuple[TensorInfo, int, int]]):
        self.bufs = bufs
        self.free: queue.LifoQueue[int] = queue.LifoQueue()  # the warmest buffer first
        for i in reversed(range(len(bufs))):
            self.free.put(i)
        self.holds = [0] * len(bufs)
        self.lock = threading.Lock()
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.fds: dict[str, int] = {}
        self.pool = ThreadPoolExecutor(min(READERS, os.cpu_count() or 1), thread_name_prefix="verify-read")
        self.thread = threading.Thread(target=self._dispatch, args=(chunks,), daemon=True, name="verify-ring")
        self.thread.start()

    def _dispatch(self, chunks: Iterator[tuple[TensorInfo, int, int]]) -> None:
        try:
            for t, b0, b1 in chunks:
                if b1 == b0:
                    self.ready.put((None, t, b0, b1))
                    continue
                i = self.free.get()
                if self.stop.is_set():
                    return
                self.holds[i] = 1
                fd = self.fds.get(t.path)
                if fd is None:
                    fd = self.fds[t.path] = os.open(t.path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self.ready.put((self.pool.submit(self._read, fd, i, t, b0, b1), t, b0, b1))
            self.ready.put(None)
        except BaseException as e:  # handed to the consumer, which raises it
            self.ready.put(e)

    def _read(self, fd: int, i: int, t: TensorInfo, b0: int, b1: int) -> int:
        n, at = (b1 - b0) * t.type_size, t.offset + b0 * t.type_size
        view = memoryview(self.bufs[i])[:n]
        got = 0
        while got < n:
            k = os.preadv(fd, [view[got:]], at + got)
            if k == 0:
                raise OSError(f"{t.path}: short read of {got} of {n} bytes at {at}")
            got += k
        return i

    def __iter__(self) -> Iterator[tuple[int | None, TensorInfo, int, int]]:
        while (item := self.ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            fut, t, b0, b1 = item
            yield (fut.result() if isinstance(fut, Future) else None), t, b0, b1

    def hold(self, i: int) -> None:
        with self.lock:
            self.holds[i] += 1

    def release(self, i: int) -> None:
        with self.lock:
            self.holds[i] -= 1
            if self.holds[i] == 0:
                self.free.put(i)

    def close(self) -> None:
        self.stop.set()
        self.free.put(0)  # wakes a dispatcher waiting for a buffer
        self.thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        for fd in self.fds.values():
            os.close(fd)


class _Workers:
    """One thread per core; every task of one tensor goes to the same thread, in the order handed in,
    while different tensors' run at once. A new tensor goes to the thread with the fewest bytes queued."""

    def __init__(self, n: int):
        self.q: list[queue.Queue] = [queue.Queue() for _ in range(n)]
        self.queued = [0] * n
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.aborted = False  # the dispatching thread gave up: queued tasks only release their buffers
        self.threads = [threading.Thread(target=self._work, args=(k,), daemon=True, name=f"verify-work-{k}")
                        for k in range(n)]
        for th in self.threads:
            th.start()

    def pick(self) -> int:
        with self.lock:
            return min(range(len(self.q)), key=self.queued.__getitem__)

    def put(self, k: int, nbytes: int, fn: Callable, *args: Any) -> None:
        if self.error is not None:
            raise self.error
        with self.lock:
            self.queued[k] += nbytes
        self.q[k].put((nbytes, fn, args))

    def _work(self, k: int) -> None:
        torch.set_num_threads(1)  # a new thread has the default count (OpenMP's is per thread): one core each
        with torch.inference_mode():
            while (item := self.q[k].get()) is not None:
                nbytes, fn, args = item
                try:
                    fn(*args, skip=self.aborted or self.error is not None)
                except BaseException as e:  # raised on the dispatching thread
                    self.error = e
                finally:
                    with self.lock:
                        self.queued[k] -= nbytes

    def close(self, abort: bool = False) -> None:
        self.aborted = self.aborted or abort
        for q in self.q:
            q.put(None)
        for th in self.threads:
            th.join()
        if self.error is not None:
            raise self.error


_scratch = threading.local()


def _values_buffer() -> torch.Tensor:
    """This worker's float32 [CHUNK_VALUES] output buffer, reused for every piece."""
    if getattr(_scratch, "out", None) is None:
        _scratch.out = torch.empty(CHUNK_VALUES, dtype=torch.float32)
    return _scratch.out


def _piece_blocks(t: TensorInfo) -> int:
    """Blocks per piece: CHUNK_VALUES values (one block at least)."""
    return max(1, CHUNK_VALUES // t.block_size)


def _pieces(t: TensorInfo, raw: np.ndarray) -> Iterator[tuple[int, int, np.ndarray]]:
    """(first block, end block, their bytes) of each CHUNK_VALUES piece of a chunk's raw blocks, counted
    from the chunk's start."""
    unit, n = _piece_blocks(t), raw.size // t.type_size
    for c0 in range(0, n, unit):
        c1 = min(c0 + unit, n)
        yield c0, c1, raw[c0 * t.type_size : c1 * t.type_size]


def _decode_cpu(tw: _Tensor, ring: _Ring, i: int, j: int, b0: int, b1: int, *, skip: bool) -> None:
    """A worker's task: decode chunk j (in buffer i) piece by piece into this worker's buffer, checking
    each piece while it is in cache and feeding it to the chunk's own statistics."""
    part = None
    try:
        if not skip:
            t, part = tw.t, _Part(tw, checks=True)
            bs, ts = t.block_size, t.type_size
            out = _values_buffer()
            chunk = ring.bufs[i][: (b1 - b0) * ts]
            decoder = native_decoding(t.type) if part.acc is not None else None
            if decoder is not None:  # the whole chunk in one native call; only a piece with inf/NaN comes back
                unit = _piece_blocks(t)
                finite_values = (b1 - b0) * bs
                for p in part.acc.add_decoded(chunk.reshape(-1, ts), decoder, unit, out):  # type: ignore[union-attr]
                    raw = chunk[p * unit * ts : (p + 1) * unit * ts]
                    v = dequantize(raw, t.type, (raw.size // ts * bs,))
                    finite_values -= v.numel()
                    _check_chunk(part.rep, v, b0 + p * unit, bs, ts, False)  # type: ignore[arg-type]
                part.rep.values += finite_values  # type: ignore[union-attr]
            else:
                for c0, c1, raw in _pieces(t, chunk):
                    v = out[: (c1 - c0) * bs]
                    dequantize(raw, t.type, (c1 - c0, bs), out=v.view(c1 - c0, bs))
                    finite = part.acc.add(raw.reshape(-1, ts) if part.acc.fields else None, v) \
                        if part.acc is not None else None
                    _check_chunk(part.rep, v, b0 + c0, bs, ts, finite)  # type: ignore[arg-type]
    finally:
        ring.release(i)
        tw.done(j, part, skip)


def _host_blocks(tw: _Tensor, ring: _Ring, i: int, j: int, b0: int, b1: int, *, skip: bool) -> None:
    """A worker's task (CUDA): the raw blocks' statistics of chunk j (in buffer i), piece by piece as
    the CPU pass gathers them."""
    part = None
    try:
        if not skip:
            part, t = _Part(tw, checks=False), tw.t
            if part.acc is not None and (part.acc.fields or part.acc.subblocks is not None):
                chunk = ring.bufs[i][: (b1 - b0) * t.type_size]
                part.acc.add_blocks_in_pieces(chunk.reshape(-1, t.type_size), _piece_blocks(t))
    finally:
        ring.release(i)
        tw.done(j, part, skip)


def _hash(tw: _Tensor, ring: _Ring, i: int, b0: int, b1: int, *, skip: bool) -> None:
    """The owner's task: the chunk in buffer i into the tensor's sha256 (the owner gets them in order)."""
    try:
        if not skip:
            tw.sha.update(ring.bufs[i][: (b1 - b0) * tw.t.type_size])  # type: ignore[union-attr]
    finally:
        ring.release(i)
        tw.done(None, None, skip)


def _host_buffers(size: int, n: int) -> list[np.ndarray]:
    """n uint8 [size] buffers in one anonymous mapping advised for huge pages: a first touch of 4 KiB
    pages cost 2.5 CPU-s per GB on the dev VM (600 MB: 1.5 CPU-s fresh, 0.12 reused, 0.42 with
    MADV_HUGEPAGE), paid once per buffer since the ring hands the most recently freed buffer out first."""
    m = mmap.mmap(-1, size * n)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return [np.frombuffer(m, np.uint8, size, i * size) for i in range(n)]


def _workers() -> int:
    """One per core of this process, shared among the ranks of a `verify --gpus N` run (one host)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        n //= torch.distributed.get_world_size()
    return max(1, n)


def _pass(g: GGUFFile, device: str, progress: Callable, hashing: bool,
          names: Collection[str] | None = None) -> list[_Tensor]:
    """Every tensor (of `names`) through the ring and the workers; CUDA: decoded on the GPU here.
    Per chunk: its decoding (CPU) or raw blocks' statistics (CUDA) on the least busy worker, its hash
    on the tensor's owner, and its values on the GPU by this thread."""
    tensors = list(_tensors_in_file_order(g, names))
    limit = READ_BYTES[device]
    plan = list(_chunks(tensors, limit, hashing))
    chunks = Counter(t.name for t, b0, b1 in plan if b1 > b0)
    size = max([(b1 - b0) * t.type_size for t, b0, b1 in plan] + [1])  # the largest chunk (>= limit: a piece)
    n_bufs = max(1, min(RING_BYTES // size, RING_PER_WORKER * _workers(), sum(chunks.values())))
    gpu = _Gpu(tensors, size, n_bufs) if device == "cuda" else None
    bufs = [b.numpy() for b in gpu.host] if gpu else _host_buffers(size, n_bufs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ring, workers = _Ring(bufs, iter(plan)), _Workers(_workers())
    out: list[_Tensor] = []
    done, owner, j, ok = 0, 0, 0, False
    try:
        for i, t, b0, b1 in ring:
            if not out or out[-1].t is not t:
                per_chunk = int(hashing) + (1 + int(gpu is not None)) * int(_decoded(t))
                out.append(_Tensor(t, hashing, chunks[t.name] * per_chunk, gpu is not None))
                owner, j = workers.pick(), 0
                if not out[-1].left:
                    out[-1].finish()
            tw = out[-1]
            if i is None:
                done += t.nbytes
            else:
                n = (b1 - b0) * t.type_size
                if hashing:
                    ring.hold(i)
                    workers.put(owner, n, _hash, tw, ring, i, b0, b1)
                if _decoded(t):
                    ring.hold(i)
                    workers.put(workers.pick(), n, _host_blocks if gpu else _decode_cpu, tw, ring, i, j, b0, b1)
                    if gpu is not None:
                        ring.hold(i)
                        gpu.chunk(tw, ring, i, b0, b1)
                        tw.done(None, None, False)
                ring.release(i)  # this thread's own hold
                done += n
                j += 1
            progress(done, t.name)
        ok = True
    finally:
        try:
            ring.close()
        finally:
            workers.close(abort=not ok)
            torch.set_num_threads(threads)
    return out


class _Gpu:
    """CUDA: each chunk copied from its pinned buffer on a stream of its own, decoded by the Triton
    kernels into one output buffer, checked, and its values' statistics gathered on the GPU; the
    buffer is released to the ring once the copy is done."""

    def __init__(self, tensors: list[TensorInfo], limit: int, n_bufs: int):
        self.dev = torch.device("cuda")
        self.host = [torch.empty(limit, dtype=torch.uint8).pin_memory() for _ in range(n_bufs)]  # the ring's
        self.raw = torch.empty(limit, dtype=torch.uint8, device=self.dev)
        per_byte = max((t.block_size / t.type_size for t in tensors if _decoded(t)), default=0)
        self.out = torch.empty(math.ceil(limit * per_byte), dtype=torch.float32, device=self.dev)  # any chunk's values
        self.stream = torch.cuda.Stream()
        self.copied = torch.cuda.Event()

    def chunk(self, tw: _Tensor, ring: _Ring, i: int, b0: int, b1: int) -> None:
        t = tw.t
        try:
            if not _decoded(t):
                return
            n, bs = (b1 - b0) * t.type_size, t.block_size
            with torch.cuda.stream(self.stream):
                self.raw[:n].copy_(self.host[i][:n], non_blocking=True)
                self.copied.record(self.stream)
            torch.cuda.current_stream().wait_event(self.copied)
            v = self.out[: (b1 - b0) * bs]
            dequantize(self.raw[:n], t.type, (b1 - b0, bs), out=v.view(b1 - b0, bs))
            # the blocks' half of the statistics: the workers' (_host_blocks)
            finite = tw.gpu_acc.add_values(v) if tw.gpu_acc is not None else None
            _check_chunk(tw.rep, v, b0, bs, t.type_size, finite)
            self.copied.synchronize()
        finally:
            ring.release(i)


# ---- entry point -------------------------------------------------------------------------------------

def run(path: Path, *, device: str = "cpu", progress: Progress = lambda done, total, name: None,
        manifest: Path | None = None, write_manifest: bool = False, tensors: Collection[str] | None = None,
        combine: Callable[[list, list], tuple[list, list] | None] | None = None) -> Result | None:
    """Verify every tensor of the model at `path` (any shard of a split set) on `device`.

    `manifest`: also compare the file with that manifest (checks/file/manifest.py), and `write_manifest`:
    return the file's manifest in Result.manifest; either way the tensors' sha256 are computed in the
    same pass, from the same reads.
    Spread over ranks (checks/file/verify_ranks.py): `tensors` restricts the pass to a rank's share, and
    `combine(reports, stats)` gathers every rank's before the findings are built, returning them all
    on the rank that reports and None on the others (run then returns None)."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    hashing = manifest is not None or write_manifest
    with open_gguf(path) as g:
        total = sum(t.nbytes for t in g.tensors)
        shards = [s.path for s in g.shards]
        if device == "cuda" and not torch.cuda.is_available():
            f = Finding(CHECK, "cuda", "all", "skip", reason="skipped: --device cuda, but CUDA is not available")
            return Result([f], [], total, 0.0, device, shards)
        t0 = time.perf_counter()
        with torch.inference_mode():
            done = _pass(g, device, lambda n, name: progress(n, total, name), hashing, tensors)
        reports = [tw.rep for tw in done]
        stats = [tw.stats for tw in done if tw.stats is not None]
        if combine is not None:
            joined = combine(reports, stats)
            if joined is None:
                return None
            reports, stats = joined
        seconds = time.perf_counter() - t0
        findings = [r.finding() for r in reports] + forensics.compare(stats, file=g.path)
        doc = None
        if hashing:
            from . import manifest as MF

            doc = MF.build(g, hashes={r.name: r.sha256 for r in reports})
            if manifest is not None:
                findings += MF.compare(g, manifest, built=doc)
    return Result(findings, reports, total, seconds, device, shards, doc if write_manifest else None)
