"""The GGUF file layer: a hardened reader, dequantization, layouts.

`dequantize` is imported lazily so that reading a file never imports torch.
"""

from typing import Any

from ..errors import GGUFError
from .reader import GGUFFile, MetadataField, StringArray, TensorInfo
from .split import open_gguf

__all__ = ["GGUFError", "GGUFFile", "MetadataField", "StringArray", "TensorInfo", "dequantize", "open_gguf"]


def __getattr__(name: str) -> Any:
    if name == "dequantize":
        from .dequant import dequantize

        return dequantize
    raise AttributeError(name)
