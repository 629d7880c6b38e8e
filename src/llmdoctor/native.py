"""The one loader of llmdoctor's optional C extensions (built by setup.py, called through ctypes so
that calls run outside the GIL). Each library exports an interface number; an editable install does
not rebuild a C file, so a library of another interface is refused rather than called wrongly."""

from __future__ import annotations

import ctypes
import importlib.util


def load_extension(module: str, abi_function: str, abi: int) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not) for the extension `module` whose `abi_function()` must be `abi`."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin:
        return None, f"{module} was not built (no C compiler at install time?)"
    try:
        lib = ctypes.CDLL(spec.origin)
        got = getattr(lib, abi_function)()
    except (OSError, AttributeError) as e:
        return None, f"cannot load {spec.origin} ({e}): rebuild it (pip install -e .)"
    if got != abi:
        return None, f"{spec.origin} is a stale build (interface {got}, expected {abi}): rebuild it (pip install -e .)"
    return lib, ""
