"""The common JSON envelope of every command's `--json`, with the provenance block.

Non-finite floats are written as the strings "nan", "inf", "-inf" (plain json.dumps would write
invalid JSON). Reports are written atomically (temp file + rename).
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Iterable

from .. import __version__
from ..checks.base import Finding, count
from ..file_digest import sha256_file
from ..errors import InputError

# Environment variables that change which kernels an engine picks or how it computes.
BACKEND_ENV_VARS = (
    "CUDA_VISIBLE_DEVICES",
    "VLLM_ATTENTION_BACKEND",
    "VLLM_USE_V1",
    "VLLM_MLA_DISABLE",
    "VLLM_USE_TRITON_FLASH_ATTN",
    "VLLM_FLASH_ATTN_VERSION",
    "LLAMA_ARG_FLASH_ATTN",
    "GGML_CUDA_FORCE_MMQ",
    "GGML_CUDA_FORCE_CUBLAS",
    "TORCH_CUDNN_SDPA_ENABLED",
    "OMP_NUM_THREADS",
)
_PACKAGES = {"torch": "torch", "triton": "triton", "gguf": "gguf", "numpy": "numpy"}
_ENGINES = {"llama_cpp": "llama-cpp-python", "transformers": "transformers", "vllm": "vllm"}


def _pkg_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu() -> tuple[str | None, str | None]:
    """GPU name and compute capability, only when torch is already loaded (never imported for this)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None, None
    major, minor = torch.cuda.get_device_capability()
    return torch.cuda.get_device_name(), f"{major}.{minor}"


def provenance(file: str | os.PathLike | None = None, seed: int | None = None) -> dict[str, Any]:
    """Everything needed to re-run a finding: versions, GPU, backend env vars, seed, file hash."""
    gpu, cc = _gpu()
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{k: _pkg_version(d) for k, d in _PACKAGES.items()},
        "engines": {k: _pkg_version(d) for k, d in _ENGINES.items()},
        "gpu": gpu,
        "compute_capability": cc,
        "backend_env": {k: os.environ[k] for k in BACKEND_ENV_VARS if k in os.environ},
        "seed": seed,
        "file": None,
    }
    if file is not None:
        env["file"] = {"path": str(Path(file).resolve()), "sha256": sha256_file(file)}
    return env


def envelope(
    command: str,
    *,
    argv: list[str],
    verdict: str,
    exit_code: int,
    findings: Iterable[Finding] = (),
    file: str | os.PathLike | None = None,
    seed: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    findings = list(findings)
    out = {
        "schema": f"llmdoctor.{command}/1",
        "version": __version__,
        "argv": argv,
        "env": provenance(file, seed),
        "verdict": verdict,
        "exit_code": exit_code,
        "counts": count(findings),
        "findings": [f.to_dict() for f in findings],
    }
    out.update(extra)
    return out


def _finite(x: Any) -> Any:
    """Replace non-finite floats (also numpy scalars and arrays) by strings, recursively."""
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    if hasattr(x, "tolist"):  # numpy / torch scalars and arrays
        return _finite(x.tolist())
    return x


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    return json.dumps(_finite(obj), indent=indent, allow_nan=False, default=str)


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write a report via temp file + rename, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass  # never created
        raise InputError(f"{path}: cannot write the report: {e.strerror}") from None


def check_writable(path: str | os.PathLike | None) -> None:
    """Fail before the work, not after it: the report's folder must exist and be writable."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise InputError(f"{path}: cannot write the report: {parent} is not a writable folder")
