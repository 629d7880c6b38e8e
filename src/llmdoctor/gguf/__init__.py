"""The GGUF file layer: a hardened reader (and, later, dequantization and layouts)."""

from ..errors import GGUFError
from .reader import GGUFFile, MetadataField, StringArray, TensorInfo, open_gguf

__all__ = ["GGUFError", "GGUFFile", "MetadataField", "StringArray", "TensorInfo", "open_gguf"]
