"""The one dequant-kernel loader: built-in kernels and `module:function` specs, served in an isolated
child (`serve`) through `IsolatedKernel` (what `check dequant`'s caller hands it, and op substitution's).

Every kernel follows the contract of `llmdoctor check dequant` (issue 3):
    fn(raw: torch.Tensor, qtype: int, shape: tuple[int, ...]) -> torch.Tensor
called as `fn(raw, qtype, shape, dtype=D)` only when a dtype is requested. `raw` is a private,
writable, 1-D contiguous uint8 copy of the whole tensor's bytes as stored in the file; `qtype` the
GGML type number; `shape` the row-major logical shape (GGUF `ne` reversed). A kernel that does not
handle a type raises NotImplementedError (`Unsupported`): that tensor is skipped, not failed.

Built-ins: `reference` (gguf-py, the oracle), `torch` (llmdoctor.gguf.dequantize with its torch
kernels), `native` (llmdoctor.gguf.dequantize as it runs on the CPU by default: the fused C kernels
where a type has one, the torch kernels elsewhere; CPU only), `ggml` (the C
`to_float` of the libggml shipped with llama-cpp-python, through ctypes, CPU only), `vllm`
(the vllm-gguf-plugin's `ggml_dequantize`, or vLLM's in-tree one before the plugin; CUDA only; the
types vLLM never dequantizes, F32/F16/BF16 among them, are skipped with the reason).
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import InputError
from ..outcomes import Outcome
from .isolation import Isolated
from .kernel_errors import KernelUnavailable, Unsupported

Kernel = Callable[..., torch.Tensor]
BUILTINS = ("reference", "torch", "native", "ggml", "vllm")


def validate_spec(spec: str, flag: str = "--kernel") -> None:
    """Cheap checks done before any child starts; InputError names what is wrong with `spec` (given as `flag`)."""
    if flag == "--kernel" and spec in BUILTINS:
        return
    if ":" not in spec:
        raise InputError(f"{flag} {spec!r}: not a built-in ({', '.join(BUILTINS)}) nor module:function")
    module, _, func = spec.rpartition(":")
    if not module or not func.isidentifier():
        raise InputError(f"{flag} {spec!r}: expected module:function")
    if module.endswith(".py") and not Path(module).is_file():
        raise InputError(f"{flag} {spec!r}: no such file {module}")


def load(spec: str, device: str, flag: str = "--kernel") -> Kernel:
    """Resolve `spec` to a kernel for `device`. InputError: a bad spec; KernelUnavailable: cannot run.
    `flag` names the option in messages; other commands' built-ins are theirs (--impl: module:function only)."""
    validate_spec(spec, flag)
    if flag == "--kernel" and spec in BUILTINS:
        return _BUILTIN_LOADERS[spec](device)
    module, _, func = spec.rpartition(":")
    if module.endswith(".py"):
        path = Path(module).resolve()
        mspec = importlib.util.spec_from_file_location(f"llmdoctor_kernel_{path.stem}", path)
        mod = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(mod)
    else:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            raise InputError(f"{flag} {spec!r}: cannot import {module}: {e}") from None
    fn = getattr(mod, func, None)
    if not callable(fn):
        raise InputError(f"{flag} {spec!r}: {module} has no function {func}")
    return fn


# ----------------------------------------------------------------------------- built-ins

def _reference(device: str) -> Kernel:
    import gguf

    def reference(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None):
        values = gguf.quants.dequantize(raw.cpu().numpy(), gguf.GGMLQuantizationType(qtype))  # f32 [n]
        out = torch.from_numpy(values.reshape(shape))
        return out if dtype is None else out.to(dtype)

    return reference


def _ours(native: bool) -> Kernel:
    from ..gguf import dequantize

    def ours(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None):
        try:
            return dequantize(raw, qtype, shape, dtype=dtype or torch.float32, native=native)
        except InputError as e:
            if str(e).startswith("no dequantizer"):
                raise Unsupported(str(e)) from None
            raise

    return ours


def _torch(device: str) -> Kernel:
    return _ours(native=False)


def _native(device: str) -> Kernel:
    from ..gguf.dequant_native import available

    if device != "cpu":
        raise KernelUnavailable("native: the fused C kernels run on the CPU only")
    ok, why = available()
    if not ok:
        raise KernelUnavailable(f"native: {why}")
    return _ours(native=True)


class _GGMLTypeTraits(ctypes.Structure):
    """`struct ggml_type_traits` from ggml/include/ggml.h (the layout libggml-base exports)."""

    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


# typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);  k = number of elements
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def _ggml(device: str) -> Kernel:
    if device != "cpu":
        raise KernelUnavailable("ggml: libggml's to_float runs on the CPU only")
    try:
        import llama_cpp
    except ImportError as e:
        raise KernelUnavailable(f"ggml: llama-cpp-python is not importable ({e})") from None
    lib_path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    try:
        lib = ctypes.CDLL(os.fspath(lib_path))
    except OSError as e:
        raise KernelUnavailable(f"ggml: cannot load {lib_path} ({e})") from None
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_GGMLTypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    import gguf

    known = {int(t) for t in gguf.GGMLQuantizationType}

    def ggml(raw: torch.Tensor, qtype: int, shape: tuple[int, ...], dtype: Optional[torch.dtype] = None):
        if qtype not in known:  # ggml_get_type_traits aborts on an out-of-range type
            raise Unsupported(f"ggml: unknown type {qtype}")
        traits = lib.ggml_get_type_traits(qtype).contents
        if not traits.to_float:
            raise Unsupported(f"ggml: {traits.type_name.decode()} has no to_float")
        n = 1
        for s in shape:
            n *= s
        if n % traits.blck_size or raw.numel() != n // traits.blck_size * traits.type_size:
            raise ValueError(f"ggml: {raw.numel()} bytes do not hold {n} {traits.type_name.decode()} values")
        src = raw.cpu().contiguous()
        out = torch.empty(n, dtype=torch.float32)  # f32 [n]
        _TO_FLOAT(traits.to_float)(src.data_ptr(), out.data_ptr(), n)
        out = out.reshape(shape)
        return out if dtype is None else out.to(dtype)

    return ggml


def _vllm(device: str) -> Kernel:
    from .engines import vllm_kernels as vllm

    return vllm.dequant_kernel(device)


_BUILTIN_LOADERS: dict[str, Callable[[str], Kernel]] = {
    "reference": _reference, "torch": _torch, "native": _native, "ggml": _ggml, "vllm": _vllm,
}


# ----------------------------------------------------------------------------- serving in a child

def serve(spec: str, device: str, dtype: Optional[str]) -> Callable:
    """Handler factory for `subjects.isolation.Isolated`: load the kernel once, then answer calls.

    Request header: qtype, shape, block_size, blocks (indices of the blocks to send back; None: all). The reply
    carries the output's dtype/device and, as payload, the raw bytes of those blocks only (what the
    check compares), plus a count of non-finite elements over the whole output and the first few
    of them. A contract violation is a reply with status 'contract' saying what was returned.
    """
    fn = load(spec, device)
    want = getattr(torch, dtype) if dtype else None
    if device.startswith("cuda"):
        torch.zeros(1, device=device)  # create the CUDA context at load time, not inside the first call

    def handle(header: dict, payload: bytearray) -> tuple[dict, Any]:
        shape = tuple(header["shape"])
        raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        if device != "cpu":
            raw = raw.to(device)
        t0 = time.perf_counter()
        try:
            out = fn(raw, header["qtype"], shape) if want is None else fn(raw, header["qtype"], shape, dtype=want)
            if isinstance(out, torch.Tensor) and out.is_cuda:
                torch.cuda.synchronize(out.device)
        except NotImplementedError as e:
            return {"status": "unsupported", "message": str(e) or "NotImplementedError"}, b""
        seconds = time.perf_counter() - t0
        problem = _contract_violation(out, shape, want)
        if problem:
            return {"status": "contract", "message": problem}, b""
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # our few passes over the output: thread hand-offs cost more on a busy host
        try:
            return _reply(out, header["blocks"], header["block_size"], seconds)
        finally:
            torch.set_num_threads(threads)

    return handle


class IsolatedKernel:
    """The kernel `spec` served in an isolated child (`serve`), for `check dequant` and op substitution.
    A malformed spec raises InputError at once (before any child starts). Context manager; `start` raises
    LoadFailed when the child cannot build the kernel."""

    def __init__(self, spec: str, *, device: str = "cpu", dtype: Optional[str] = None, timeout: float = 120.0):
        validate_spec(spec)
        self.spec = spec
        self._iso = Isolated("llmdoctor.subjects.kernels:serve", (spec, device, dtype), call_timeout=timeout)

    def __enter__(self) -> "IsolatedKernel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._iso.start()

    def close(self) -> None:
        self._iso.close()

    @property
    def restarts(self) -> int:
        """Fresh children started after a crash or hang."""
        return self._iso.restarts

    def dequantize(self, raw: Any, qtype: int, shape: list[int], block_size: int,
                   blocks: Optional[Any] = None) -> Outcome:
        """One tensor's bytes (`raw`, a buffer) through the kernel; the reply holds the blocks at indices
        `blocks` (None: all) as raw bytes of the output's dtype (`serve`)."""
        n_blocks = len(blocks) if blocks is not None else math.prod(shape) // block_size
        return self._iso.call({"qtype": qtype, "shape": shape, "block_size": block_size, "blocks": blocks}, raw,
                              reply_hint=n_blocks * block_size * 4)  # float32-sized reply


def _reply(out: torch.Tensor, blocks: Any, bs: int, seconds: float) -> tuple[dict, Any]:
    """Reply header and payload: the compared blocks' raw bytes and the non-finite census."""
    flat = out.detach().reshape(-1)  # [n]
    n_bad, first_bad = 0, torch.zeros(0, dtype=torch.int64, device=flat.device)
    # A finite sum proves every element finite (NaN and inf propagate through a sum) in one cheap pass;
    # only a non-finite sum (or an overflowing one) pays for the element-wise census.
    acc = torch.float64 if flat.dtype == torch.float64 else torch.float32
    if not bool(torch.isfinite(torch.sum(flat, dtype=acc))):
        bad = ~torch.isfinite(flat)
        n_bad = int(bad.sum())
        first_bad = bad.nonzero().flatten()[:16]
    picked = flat.view(-1, bs)  # [n_blocks, block_size]; blocks None = all of them
    if blocks is not None:
        picked = picked.index_select(0, torch.as_tensor(blocks, dtype=torch.int64, device=flat.device))
    picked = picked.cpu().contiguous()  # [k, block_size]
    reply = {"status": "ok", "dtype": str(out.dtype).removeprefix("torch."), "device": str(out.device),
             "seconds": seconds, "nonfinite": n_bad, "nonfinite_at": first_bad.cpu().tolist(),
             "nonfinite_values": flat[first_bad].double().cpu().tolist()}
    return reply, picked.view(torch.uint8).numpy().reshape(-1)


def _contract_violation(out: Any, shape: tuple[int, ...], want: Optional[torch.dtype]) -> str:
    """'' when `out` honours the contract, else what was returned instead."""
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a torch.Tensor"
    what = f"returned {str(out.dtype).removeprefix('torch.')} tensor of shape {tuple(out.shape)}"
    if not out.is_floating_point():
        return f"{what}: not a floating tensor"
    if tuple(out.shape) != shape:
        return f"{what}, expected shape {shape}"
    if want is not None and out.dtype != want:
        return f"{what}, expected dtype {str(want).removeprefix('torch.')}"
    return ""
