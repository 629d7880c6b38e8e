"""An HF checkpoint's tokenizer, behind the interface `logits.report` and diagnose use from
reference/tokenizer.py's GGUF tokenizer: `encode(text, add_bos)`, `decode(ids, special=)`, `eog_ids`.

A checkpoint with tokenizer files is tokenized by transformers' AutoTokenizer, as the deployments that
serve checkpoints tokenize (vLLM's `get_tokenizer` and transformers' pipelines both load AutoTokenizer;
`add_special_tokens=True` is their default for a prompt). A checkpoint without one (tiny random test
models) takes its prompts as token ids (`--token-ids 1,2,3`); a token's text is then its id in brackets.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import InputError
from ..hf_config import read_hf_config, text_config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(directory: str | os.PathLike) -> bool:
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def _eos_ids(directory: Path) -> set[int]:
    """End-of-generation ids: config.json's and generation_config.json's eos_token_id (int or list)."""
    out: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        p = directory / name
        if p.is_file():
            v = text_config(read_hf_config(p)).get("eos_token_id")
            out.update(v if isinstance(v, list) else [] if v is None else [v])
    return {int(i) for i in out}


class HFTokenizer:
    """transformers' AutoTokenizer of a checkpoint directory (local files only)."""

    def __init__(self, directory: str | os.PathLike):
        from transformers import AutoTokenizer

        self.directory = Path(directory)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as e:  # transformers raises OSError/ValueError/ImportError variants for bad files
            raise InputError(f"{self.directory}: its tokenizer cannot be loaded ({type(e).__name__}: {e}); "
                             "give the prompt as --token-ids") from None
        self.eog_ids = _eos_ids(self.directory) | ({self.tok.eos_token_id} if self.tok.eos_token_id is not None else set())

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=True if add_bos is None else add_bos))

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=not special)


class TokenIds:
    """No tokenizer: prompts come as token ids; a token's text is its id in brackets."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.eog_ids = _eos_ids(self.directory)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        raise InputError(f"{self.directory} has no tokenizer ({', '.join(TOKENIZER_FILES)}): give the prompt as "
                         "--token-ids 1,2,3")

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return "".join(f"[{int(i)}]" for i in ids)


def checkpoint_tokenizer(directory: str | os.PathLike) -> HFTokenizer | TokenIds:
    """The checkpoint's own tokenizer, or `TokenIds` when it ships none."""
    return HFTokenizer(directory) if has_tokenizer(directory) else TokenIds(directory)


def parse_token_ids(text: str) -> list[int]:
    """`--token-ids 1,2,3` -> [1, 2, 3] (commas and/or spaces); InputError on anything else."""
    parts = [p for p in text.replace(",", " ").split() if p]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise InputError(f"--token-ids {text!r}: expected integers separated by commas") from None
    if not ids or min(ids) < 0:
        raise InputError(f"--token-ids {text!r}: expected one or more non-negative integers")
    return ids
