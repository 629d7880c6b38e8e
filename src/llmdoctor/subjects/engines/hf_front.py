"""A deployment's HF tokenizer folder as the engines that load one use it: transformers' AutoTokenizer
(local files only), as transformers' pipelines, vLLM's `get_tokenizer` and llama-cpp-python's
`hf_pretrained_model_name_or_path` load it.

Prompt text: `encode(text, add_special_tokens=True)` (transformers' and vLLM's completion default; what
llama-cpp-python's LlamaHFTokenizer passes for `special=True`). A chat: the folder's chat template through
`apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`, then the rendered text
tokenized with `add_special_tokens` as the engine's chat route does (transformers' and vLLM's: False; the
template writes its own BOS).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .base import EngineError, NotOffered


class HFFrontEnd:
    def __init__(self, directory: str | os.PathLike):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/ImportError variants for a bad folder
            raise EngineError(f"the tokenizer in {self.directory} cannot be loaded: {type(e).__name__}: {e}") from None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=True)]

    def chat(self, messages: list[dict[str, str]], *, add_special_tokens: bool = False) -> tuple[str, list[int]]:
        if not getattr(self.tok, "chat_template", None):
            raise NotOffered(f"the tokenizer in {self.directory} has no chat template (a chat request is refused)")
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return text, [int(t) for t in self.tok.encode(text, add_special_tokens=add_special_tokens)]

    def describe(self, chat_add_special: bool = False) -> dict[str, Any]:
        return {"tokenizer": os.fspath(self.directory), "loaded_by": "transformers AutoTokenizer",
                "class": type(self.tok).__name__, "add_special_tokens": True,
                "chat_template": bool(getattr(self.tok, "chat_template", None)),
                "chat_add_special_tokens": chat_add_special}
