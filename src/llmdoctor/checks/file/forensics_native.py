"""The C passes of weight forensics (_forensics_native.c, built by setup.py as an optional extension and
called through ctypes so that calls run outside the GIL): the moments' scan and centered sums, the
float16 scale codes' counts, the sub-block codes' histograms, and the decode-and-sum of whole chunks.
`NATIVE` is None where the library is not built; every caller then takes its numpy / torch path."""

from __future__ import annotations

import ctypes

from gguf import GGMLQuantizationType as QT

from ...native import load_extension

NATIVE_ABI = 4  # llmd_fx_abi() of the C code this module calls


def _load() -> ctypes.CDLL | None:
    """The library with its functions' signatures, or None: then the torch and numpy passes."""
    lib, _ = load_extension("llmdoctor.checks.file._forensics_native", "llmd_fx_abi", NATIVE_ABI)
    if lib is None:
        return None
    lib.llmd_fx_scan.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.llmd_fx_central.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p]
    lib.llmd_fx_codes16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                    ctypes.c_void_p, ctypes.c_void_p]
    lib.llmd_fx_subblocks.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.llmd_fx_codes16_pieces.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                           ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.llmd_fx_pieces.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_double, ctypes.c_double,
                                   ctypes.c_void_p]
    for f in ("llmd_fx_scan", "llmd_fx_central", "llmd_fx_codes16", "llmd_fx_subblocks", "llmd_fx_codes16_pieces",
              "llmd_fx_pieces"):
        getattr(lib, f).restype = None
    return lib


NATIVE = _load()


def native_decoding(qtype: QT | int) -> tuple[int, int] | None:
    """The C kernel (address, table) that Accumulator.add_decoded decodes `qtype` with, or None where
    the native libraries (forensics', dequantization's) do not both have it."""
    if NATIVE is None:
        return None
    from ...gguf import dequant_native

    return dequant_native.kernel_address(qtype)
