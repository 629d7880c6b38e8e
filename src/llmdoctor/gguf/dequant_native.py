"""The fused C block kernels of `_dequant_native.c` (CPU), registered in dequant.py when built.

`pip install` compiles the C file as an optional extension (setup.py); without a compiler the
package installs anyway and the torch kernels do the work. `available()` says whether the library
loaded and, if not, why. Each C kernel is one pass over a chunk of whole blocks, bit-exact with
gguf-py like the torch kernels it stands in for (tests/gguf/test_dequant_native.py checks both against
gguf-py). A tensor is one call through ctypes (which releases the GIL); the C pool of
`_dequant_pool.c` shares its chunks between the calling thread and its helper threads. F32 is here
too, as a byte copy: a model's many small norm vectors then cost one call each, not torch ops.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Callable

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from ..native import load_extension
from .dequant import register

_MODULE = "llmdoctor.gguf._dequant_native"
_ABI = 4  # llmd_dq_abi() of the C code this module calls (an editable install does not rebuild it)
# GGML type -> (C function, whether it takes the IQ4 non-linear table)
_FUNCTIONS = {
    T.F32: ("llmd_dq_f32", False),  # a byte copy: one ctypes call instead of the torch kernel's ops
    T.Q8_0: ("llmd_dq_q8_0", False), T.Q4_0: ("llmd_dq_q4_0", False), T.Q4_1: ("llmd_dq_q4_1", False),
    T.Q5_0: ("llmd_dq_q5_0", False), T.Q5_1: ("llmd_dq_q5_1", False), T.IQ4_NL: ("llmd_dq_iq4_nl", True),
    T.Q2_K: ("llmd_dq_q2_k", False), T.Q3_K: ("llmd_dq_q3_k", False), T.Q4_K: ("llmd_dq_q4_k", False),
    T.Q5_K: ("llmd_dq_q5_k", False), T.Q6_K: ("llmd_dq_q6_k", False), T.IQ4_XS: ("llmd_dq_iq4_xs", True),
}
# The IQ4 non-linear values, from gguf-py (a format constant, not copied into the C code).
_IQ4_KVALUES = np.array(gq.IQ4_NL.kvalues, dtype=np.int8)


def _load() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    lib, why = load_extension(_MODULE, "llmd_dq_abi", _ABI)
    if lib is None:
        return None, why
    missing = [name for name, _ in _FUNCTIONS.values() if not hasattr(lib, name)]
    if missing or not hasattr(lib, "llmd_dq_parallel"):
        return None, f"{_MODULE} is a stale build (no {', '.join(missing) or 'llmd_dq_parallel'}): rebuild it (pip install -e .)"
    lib.llmd_dq_layout.restype = ctypes.c_char_p
    layout = {}
    for item in lib.llmd_dq_layout().decode().split():
        name, block_size, type_size = item.split(":")
        layout[T[name]] = (int(block_size), int(type_size))
    for q in _FUNCTIONS:
        if layout.get(q) != GGML_QUANT_SIZES[q]:
            return None, (f"{_MODULE} assumes {q.name} blocks of {layout.get(q)} (values, bytes); "
                          f"gguf says {GGML_QUANT_SIZES[q]}: rebuild it")
    return lib, ""


_LIB, _WHY_NOT = _load()


def available() -> tuple[bool, str]:
    """(True, "") when the native kernels are loaded, else (False, the reason)."""
    return _LIB is not None, _WHY_NOT


# GGML type -> (its C kernel's address, its table's or 0): for C callers that decode as they go
# (checks/file/tensor_stats.py's Accumulator.add_decoded hands them to _forensics_native.c).
_ADDRESSES: dict[T, tuple[int, int]] = {}


def kernel_address(qtype: T | int) -> tuple[int, int] | None:
    """(address of the C kernel of `qtype`, of the table it takes or 0), or None where there is none."""
    return _ADDRESSES.get(T(qtype))


# One caller at a time may use the C pool (it holds one job); a concurrent caller runs its tensor on
# its own thread instead of waiting. A fork taken while another thread held it would leave the
# child's copy held for good: the child gets a fresh one.
_POOL_LOCK = threading.Lock()


def _new_pool_lock() -> None:
    global _POOL_LOCK
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_new_pool_lock)


def _make(qtype: T, name: str, takes_table: bool) -> Callable[..., torch.Tensor]:
    fn = getattr(_LIB, name)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    fn_address = ctypes.cast(fn, ctypes.c_void_p).value
    table = _IQ4_KVALUES.ctypes.data if takes_table else None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    _ADDRESSES[qtype] = (fn_address, table or 0)

    def kernel(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 blocks [n, type_size] (CPU) -> float32 [n, block_size], written into `out` if given."""
        if blocks.device.type != "cpu" or blocks.dtype != torch.uint8 or blocks.shape[-1] != type_size:
            raise ValueError(f"{qtype.name}: expected CPU uint8 blocks [n, {type_size}], got "
                             f"{blocks.dtype} {tuple(blocks.shape)} on {blocks.device}")
        blocks = blocks.contiguous()
        n = blocks.shape[0]
        dst = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else None
        if dst is None:
            dst = torch.empty((n, block_size), dtype=torch.float32)
        if n:
            fn(blocks.data_ptr(), dst.data_ptr(), n, table, 0)
        if out is not None and dst is not out:
            out.copy_(dst)
        return out if out is not None else dst

    def on_pointers(src: int, dst: int, n_blocks: int, *, chunk_blocks: int, threads: int, stream: bool) -> None:
        """n_blocks blocks at address src -> float32 at address dst (both valid for that many), in
        chunks of chunk_blocks shared by up to `threads` threads of the C pool; `stream`: write with
        non-temporal stores (for outputs far larger than the cache)."""
        if threads > 1 and _POOL_LOCK.acquire(blocking=False):
            try:
                _LIB.llmd_dq_parallel(fn_address, src, dst, n_blocks, type_size, block_size, table, int(stream),
                                      chunk_blocks, threads)
            finally:
                _POOL_LOCK.release()
        else:
            fn(src, dst, n_blocks, table, int(stream))

    kernel.on_pointers = on_pointers  # type: ignore[attr-defined]
    kernel.__name__ = kernel.__qualname__ = f"native_{qtype.name.lower()}"
    return kernel


if _LIB is not None:
    _LIB.llmd_dq_parallel.restype = None
    _LIB.llmd_dq_parallel.argtypes = [
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
    ]  # fn, src, dst, n_blocks, type_size, block_size, kvalues, stream, chunk_blocks, n_threads
    for _q, (_name, _table) in _FUNCTIONS.items():
        register(_q, device="native")(_make(_q, _name, _table))
