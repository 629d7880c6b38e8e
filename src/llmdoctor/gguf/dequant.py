"""Reference GGUF dequantization, bit-exact with gguf-py (`gguf.quants.dequantize`).

Block kernels are registered per GGML type. A block kernel maps
    blocks: uint8 [n_blocks, type_size]  ->  float32 [n_blocks, block_size]
and is written with device-agnostic torch ops, so the same code runs on CPU and CUDA. Faster kernels
may register for one device: Triton kernels for CUDA (`dequant_cuda.py`), fused C kernels for the
CPU (`dequant_native.py`, when the extension was built; `native=False` uses the torch kernels). A
kernel that also takes an `out=` float32 [n_blocks, block_size] argument writes its result there (no
extra temporary). Kernels must not write to `blocks`: it may be a read-only view of the file mapping.

The entry point `dequantize(raw, qtype, shape, ...)` follows the kernel contract of
`llmdoctor check dequant`: `raw` is the whole tensor's bytes exactly as stored in the file (1-D uint8),
`qtype` the GGML type number, `shape` the row-major logical shape (GGUF dims reversed).

The work is streamed in chunks of whole blocks: on CPU a chunk's temporaries (a few MiB) stay in
cache and its result is written once, straight into the output buffer; the chunks of a tensor of
several chunks are shared by the calling thread and `torch.get_num_threads() - 1` pool threads, each
running torch single-threaded. A native (C) kernel takes the whole tensor in one call outside the GIL
and its own thread pool (`_dequant_pool.c`) shares the chunks, whatever the tensor's size.
"""

from __future__ import annotations

import contextlib
import importlib.util

import inspect
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import InputError

if TYPE_CHECKING:
    from .reader import TensorInfo

BlockKernel = Callable[..., torch.Tensor]

_KERNELS: dict[GGMLQuantizationType, BlockKernel] = {}
_CUDA_KERNELS: dict[GGMLQuantizationType, BlockKernel] = {}
_NATIVE_KERNELS: dict[GGMLQuantizationType, BlockKernel] = {}  # CPU only
_WRITES_OUT: set[BlockKernel] = set()  # kernels that accept `out=`

# Output elements per chunk. CPU: 2M float32 (8 MiB) keeps a chunk's temporaries in the L3 cache
# while amortizing the few-us overhead of each of a kernel's 10-30 ops, and the Python (GIL) time
# each op costs the other chunk workers. Chosen from an ad hoc sweep on the demo file (one thread,
# 2^19..2^22; not a recorded benchmark: bench/bench_dequant_cpu.py measures the chosen setting).
# CUDA: large, only to bound the temporaries of the torch kernels.
_CHUNK_ELEMENTS = {"cpu": 1 << 21, "cuda": 1 << 27}
# Smallest chunk a tensor is cut into so that every worker gets one. Cutting the demo file's ~1M-value
# tensors in two for 2 workers was no faster than one thread and cost 40% more CPU (an ad hoc run of
# bench/bench_dequant_cpu.py, 2026-12-01, not recorded): each of a chunk's ops spends a few us in Python holding the
# GIL, so short chunks on two threads mostly wait for each other. So tensors of one chunk run on the
# calling thread alone, and only larger ones (the Q8_0 token embedding) are shared.
_MIN_PARALLEL_CHUNK = _CHUNK_ELEMENTS["cpu"]
# torch splits an op over its threads only above this many elements (at::internal::GRAIN_SIZE).
_TORCH_GRAIN = 32768
# Native kernels (one call per tensor, outside the GIL) share any tensor in chunks of this many values
# among the threads of their C pool: many chunks per thread let a busy core hand work to a free one.
# Demo Q5_0 tensors, 2 threads: 32K 7.95 ms, 64K 7.66, 128K 7.75, 256K 8.51, 512K 9.02 (bench/RESULTS.md).
_NATIVE_CHUNK = 1 << 16
# Outputs of at least this many bytes are written with non-temporal stores (twice this machine's
# 32 MiB L3: no reader would find them in the cache anyway), in chunks of at least 1/8 of a thread's
# share so that each thread streams long runs: the 671 MB Q8_0 embedding of the demo file took 19 ms
# instead of 24 ms (bench/RESULTS.md).
_STREAM_BYTES = 64 << 20


def register(*qtypes: GGMLQuantizationType, device: str | None = None) -> Callable[[BlockKernel], BlockKernel]:
    """Register a block kernel for `qtypes`: for every device (torch ops), or only for `device`
    "cuda" or "native" (CPU, preferred over the torch kernel unless `native=False`). A kernel with an
    `on_pointers(src_address, dst_address, n_blocks, chunk_blocks=, threads=)` attribute is called
    that way on contiguous blocks with float32 output (one call per tensor, no tensors)."""
    table = {None: _KERNELS, "cuda": _CUDA_KERNELS, "native": _NATIVE_KERNELS}[device]

    def deco(fn: BlockKernel) -> BlockKernel:
        for q in qtypes:
            table[GGMLQuantizationType(q)] = fn
        if "out" in inspect.signature(fn).parameters:
            _WRITES_OUT.add(fn)
        return fn

    return deco


_ARENA = threading.local()


def scratch(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized temporary for kernels, reused across chunks on CPU (per thread and `slot`).

    Fresh multi-MiB CPU allocations come back from the OS as new pages and pay a page fault per 4 KiB
    on first touch, which costs more than the arithmetic of a chunk; CUDA's caching allocator needs
    no help. Two live temporaries must use different slots.
    """
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    views = _ARENA.__dict__.setdefault("views", {})  # (slot, shape, dtype) -> view: ~1 us per view saved
    key = (slot, shape, dtype)
    view = views.get(key)
    if view is not None:
        return view
    n = dtype.itemsize
    for d in shape:
        n *= d
    bufs = _ARENA.__dict__.setdefault("bufs", {})
    buf = bufs.get(slot)
    if buf is None or buf.numel() < n:
        buf = bufs[slot] = torch.empty(n, dtype=torch.uint8)
        views.clear()  # views of a replaced buffer would keep it alive
    if len(views) >= 1024:  # bounded: chunk shapes vary with tensor sizes
        views.clear()
    view = views[key] = buf[:n].view(dtype).view(shape)
    return view


def supported_types() -> list[GGMLQuantizationType]:
    _load_kernels()
    return sorted(_KERNELS, key=int)


_LOADED = False


def _load_kernels() -> None:
    """Import the modules that register block kernels (once)."""
    global _LOADED
    if _LOADED:
        return
    from . import dequant_iq, dequant_native, dequant_types  # noqa: F401

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        from . import dequant_cuda  # noqa: F401  (without Triton the torch kernels run on CUDA)
    _LOADED = True


def _kernel(qtype: int, device: torch.device, native: bool = True) -> tuple[GGMLQuantizationType, BlockKernel]:
    _load_kernels()
    try:
        q = GGMLQuantizationType(qtype)
    except ValueError:
        raise InputError(f"unknown GGML type {qtype}") from None
    kernel = _KERNELS.get(q)
    if kernel is None:
        raise InputError(f"no dequantizer for {q.name} (gguf-py cannot dequantize it either)")
    if device.type == "cuda":
        kernel = _CUDA_KERNELS.get(q, kernel)
    elif device.type == "cpu" and native:
        kernel = _NATIVE_KERNELS.get(q, kernel)
    return q, kernel


_FROM_NUMPY_QUIET = False


def _from_numpy_first(array: np.ndarray) -> torch.Tensor:
    """torch.from_numpy, silencing the warning torch gives (once per process) that it cannot protect
    read-only memory such as the file mapping from writes: we never write it. Later calls skip the
    catch_warnings (~3 us each)."""
    global _FROM_NUMPY_QUIET
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(array)
    _FROM_NUMPY_QUIET = not array.flags.writeable  # torch has now given its one warning
    return tensor


def _as_uint8_tensor(raw: torch.Tensor | np.ndarray, device: torch.device | str | None) -> torch.Tensor:
    """raw as a 1-D uint8 tensor, zero-copy on CPU (a read-only numpy view is wrapped, never written)."""
    if isinstance(raw, np.ndarray):
        raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
        if _FROM_NUMPY_QUIET:
            raw = torch.from_numpy(raw)
        else:
            raw = _from_numpy_first(raw)
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8:
        raise InputError(f"raw must be uint8 bytes, got {getattr(raw, 'dtype', type(raw).__name__)}")
    raw = raw.reshape(-1)
    if device is not None:
        raw = raw.to(device)
    return raw


_POOL: tuple[int, int, ThreadPoolExecutor] | None = None  # (pid, helpers, pool)


def _cpu_pool(helpers: int) -> ThreadPoolExecutor:
    """Chunk workers that help the calling thread. They run torch single-threaded because the caller
    holds `_single_threaded` while they work: torch's thread count is one for the whole process (a
    pool thread that set it would race with the caller's restore and leave every later op of the
    process on one thread, so that the bits of multi-threaded reductions would depend on timing).

    One chunk per worker beats splitting every op over torch's intra-op threads: there, each of the
    dozen ops per chunk waits for all threads, and on a busy machine one descheduled thread stalls
    every op (measured 10x slower under load in bench/bench_dequant_cpu.py). Re-created after a fork.
    """
    global _POOL
    if _POOL is None or _POOL[:2] != (os.getpid(), helpers):
        if _POOL is not None and _POOL[0] == os.getpid():
            _POOL[2].shutdown(wait=False)  # the thread count changed: retire the old workers
        _POOL = (os.getpid(), helpers, ThreadPoolExecutor(helpers, "dequant"))
    return _POOL[2]


def _share(task: Callable[[int], None], starts: range, workers: int) -> None:
    """Run task(start) for every start on the calling thread and `workers - 1` pool threads.

    Each thread takes the next chunk when it is done with one (no fixed split), so a descheduled
    thread delays no more than its own chunk; the caller works too rather than waiting for a
    hand-off. torch runs single-threaded until every helper is done, so that the threads do not
    oversubscribe.
    """
    chunks = iter(starts)
    lock = threading.Lock()
    inference = torch.is_inference_mode_enabled()  # pool threads do not inherit inference mode

    def drain() -> None:
        with torch.inference_mode(inference):
            while True:
                with lock:
                    start = next(chunks, None)
                if start is None:
                    return
                task(start)

    with _single_threaded():  # for the pool threads too: torch's thread count is the process's
        helpers = [_cpu_pool(workers - 1).submit(drain) for _ in range(min(workers, len(starts)) - 1)]
        try:
            drain()
        finally:
            for h in helpers:
                h.result()


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """torch single-threaded on the calling thread meanwhile (no intra-op threads: one descheduled
    thread would stall every op on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _run(kernel: BlockKernel, blocks: torch.Tensor, block_size: int, result: torch.Tensor) -> None:
    """Dequantize blocks [n_blocks, type_size] into the contiguous `result` (any float dtype,
    n_blocks * block_size elements) chunk by chunk; float32 chunks are written in place."""
    n_blocks = blocks.shape[0]
    device = blocks.device.type
    workers = torch.get_num_threads() if device == "cpu" else 1
    on_pointers = getattr(kernel, "on_pointers", None)
    if on_pointers is not None and result.dtype == torch.float32 and blocks.is_contiguous():
        return _run_on_pointers(on_pointers, blocks, block_size, result, workers)
    chunk = _CHUNK_ELEMENTS.get(device, _CHUNK_ELEMENTS["cuda"])
    if workers > 1:  # at least one chunk per worker, but not so small that op overheads dominate
        chunk = max(min(chunk, -(-n_blocks * block_size // workers)), _MIN_PARALLEL_CHUNK)
    step = max(1, chunk // block_size)
    flat = result.view(-1)

    def one(start: int) -> None:
        stop = min(start + step, n_blocks)
        dst = flat[start * block_size : stop * block_size].view(-1, block_size)
        direct = result.dtype == torch.float32
        target = dst if direct else scratch("result", tuple(dst.shape), torch.float32, dst.device)
        if kernel in _WRITES_OUT:
            kernel(blocks[start:stop], out=target)
        else:
            target.copy_(kernel(blocks[start:stop]))
        if not direct:
            dst.copy_(target)

    starts = range(0, n_blocks, step)
    if workers > 1 and len(starts) > 1:
        _share(one, starts, workers)
    elif workers > 1 and n_blocks * block_size >= _TORCH_GRAIN:
        with _single_threaded():
            one(0)
    else:  # one thread, or one small chunk (torch runs that on this thread anyway)
        for start in starts:
            one(start)


def _run_on_pointers(
    on_pointers: Callable[..., None], blocks: torch.Tensor, block_size: int, result: torch.Tensor, workers: int
) -> None:
    """A native kernel over contiguous CPU blocks [n_blocks, type_size] into float32 `result`: one call
    on addresses, outside the GIL; the C pool shares its chunks among `workers` threads."""
    n_blocks = blocks.shape[0]
    chunk_blocks = max(1, _NATIVE_CHUNK // block_size)
    stream = n_blocks * block_size * 4 >= _STREAM_BYTES
    if stream:
        chunk_blocks = max(chunk_blocks, n_blocks // (8 * workers))
    on_pointers(blocks.data_ptr(), result.data_ptr(), n_blocks, chunk_blocks=chunk_blocks, threads=workers,
                stream=stream)


def dequantize(
    raw: torch.Tensor | np.ndarray,
    qtype: int,
    shape: tuple[int, ...],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    native: bool = True,
) -> torch.Tensor:
    """Dequantize a whole tensor. Returns `dtype` [*shape] on `device`.

    `device` defaults to out's device when `out` is given, else raw's. Computed in float32 (bit-exact
    with gguf-py) and cast to `dtype` chunk by chunk. With `out`, the result is written there (it must
    have `shape` and `dtype` and be on `device`) and `out` is returned. On the CPU the fused C kernels
    run where a type has one (`native=False`: the torch kernels; both are bit-exact).
    """
    if device is None and out is not None:
        device = out.device
    raw = _as_uint8_tensor(raw, device)
    q, kernel = _kernel(qtype, raw.device, native)
    if not dtype.is_floating_point:
        raise InputError(f"dtype must be a floating type, got {dtype}")
    block_size, type_size = GGML_QUANT_SIZES[q]
    shape = tuple(int(d) for d in shape)
    if not shape or any(d < 0 for d in shape) or shape[-1] % block_size:
        raise InputError(f"{q.name}: shape {shape} has no row length that is a multiple of {block_size}")
    n = 1
    for d in shape:
        n *= d
    n_blocks = n // block_size
    if raw.numel() != n_blocks * type_size:
        raise InputError(f"{q.name}: {raw.numel()} bytes for shape {shape}, expected {n_blocks * type_size}")
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=raw.device)
    elif tuple(out.shape) != shape or out.dtype != dtype or out.device != raw.device:
        raise InputError(
            f"out must be {dtype} {shape} on {raw.device}, got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    if out.is_contiguous():
        _run(kernel, raw.view(n_blocks, type_size), block_size, out)
    else:
        out.copy_(dequantize(raw, q, shape, dtype=dtype, native=native))
    return out


def dequantize_blocks(blocks: torch.Tensor | np.ndarray, qtype: int) -> torch.Tensor:
    """float32 [n, block_size] for uint8 blocks [n, type_size] (e.g. blocks sampled from a tensor), on
    the blocks' device."""
    if blocks.ndim != 2:
        raise InputError(f"blocks must be 2-D [n, type_size], got shape {tuple(blocks.shape)}")
    n, width = blocks.shape
    q, _ = _kernel(qtype, torch.device("cpu") if isinstance(blocks, np.ndarray) else blocks.device)
    block_size, type_size = GGML_QUANT_SIZES[q]
    if width != type_size:
        raise InputError(f"{q.name}: blocks have {width} bytes, a block has {type_size}")
    return dequantize(blocks, q, (n, block_size))


def dequantize_tensor(
    tensor: TensorInfo,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize one tensor of an open GGUF file, reading its bytes straight from the mmap."""
    return dequantize(tensor.data, tensor.type, tensor.shape, device=device, dtype=dtype, out=out)
