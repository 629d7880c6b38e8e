"""Reference GGUF dequantization in torch, bit-exact with gguf-py (`gguf.quants.dequantize`).

Block kernels are registered per GGML type. A block kernel maps
    blocks: uint8 [n_blocks, type_size]  ->  float32 [n_blocks, block_size]
and is written with device-agnostic torch ops, so the same code runs on CPU and CUDA. Faster CUDA
kernels (Triton) may register for the CUDA device in `dequant_cuda.py`.

The entry point `dequantize(raw, qtype, shape, ...)` follows the kernel contract of
`llmdoctor check dequant`: `raw` is the whole tensor's bytes exactly as stored in the file (1-D uint8),
`qtype` the GGML type number, `shape` the row-major logical shape (GGUF dims reversed).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import InputError

BlockKernel = Callable[[torch.Tensor], torch.Tensor]

_KERNELS: dict[GGMLQuantizationType, BlockKernel] = {}
_CUDA_KERNELS: dict[GGMLQuantizationType, BlockKernel] = {}


def register(*qtypes: GGMLQuantizationType, cuda: bool = False) -> Callable[[BlockKernel], BlockKernel]:
    """Register a block kernel for `qtypes` (for the CUDA device only when `cuda=True`)."""

    def deco(fn: BlockKernel) -> BlockKernel:
        table = _CUDA_KERNELS if cuda else _KERNELS
        for q in qtypes:
            table[GGMLQuantizationType(q)] = fn
        return fn

    return deco


def supported_types() -> list[GGMLQuantizationType]:
    _load_kernels()
    return sorted(_KERNELS, key=int)


def _load_kernels() -> None:
    """Import the modules that register block kernels (once; imports are cached)."""
    from . import dequant_iq, dequant_types  # noqa: F401

    if torch.cuda.is_available():
        from . import dequant_cuda  # noqa: F401


def _as_uint8_tensor(raw: torch.Tensor | np.ndarray, device: torch.device | str | None) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        if raw.dtype != np.uint8:
            raw = raw.view(np.uint8)
        # A read-only mmap view cannot become a torch tensor without a copy (torch needs writable
        # memory); the copy is what the streaming loop reuses via `out=` anyway.
        raw = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    if raw.dtype != torch.uint8:
        raise InputError(f"raw must be uint8 bytes, got {raw.dtype}")
    raw = raw.reshape(-1)
    if device is not None:
        raw = raw.to(device)
    return raw


def dequantize(
    raw: torch.Tensor | np.ndarray,
    qtype: int,
    shape: tuple[int, ...],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize a whole tensor. Returns `dtype` [*shape] on `device` (default: raw's device).

    Computed in float32 (bit-exact with gguf-py) and cast to `dtype` once at the end. With `out`,
    the result is written there (it must have `shape` and `dtype`) and `out` is returned.
    """
    _load_kernels()
    try:
        q = GGMLQuantizationType(qtype)
    except ValueError:
        raise InputError(f"unknown GGML type {qtype}") from None
    kernel = _KERNELS.get(q)
    if kernel is None:
        raise InputError(f"no dequantizer for {q.name}")
    raw = _as_uint8_tensor(raw, device)
    block_size, type_size = GGML_QUANT_SIZES[q]
    n = 1
    for d in shape:
        n *= d
    if not shape or shape[-1] % block_size:
        raise InputError(f"{q.name}: row length {shape[-1] if shape else None} not a multiple of {block_size}")
    n_blocks = n // block_size
    if raw.numel() != n_blocks * type_size:
        raise InputError(f"{q.name}: {raw.numel()} bytes for shape {tuple(shape)}, expected {n_blocks * type_size}")
    if raw.is_cuda:
        kernel = _CUDA_KERNELS.get(q, kernel)
    values = kernel(raw.view(n_blocks, type_size))  # float32 [n_blocks, block_size]
    values = values.reshape(shape)
    if out is None:
        return values if dtype == torch.float32 else values.to(dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise InputError(f"out must be {dtype} {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
    out.copy_(values)
    return out
