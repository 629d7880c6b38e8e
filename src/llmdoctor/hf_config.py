"""Reading an HF `config.json`: the one place that finds the file, parses it and picks the text model's
part of a multimodal wrapper (e.g. Gemma3ForConditionalGeneration keeps it under `text_config`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import InputError


def config_path(path: str | os.PathLike) -> Path:
    """`path` itself, or the config.json inside it when it is a directory."""
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def read_hf_config(path: str | os.PathLike) -> dict:
    """The JSON object of a config.json (or of a checkpoint directory's). InputError, one line, when it
    is missing, unreadable or not a JSON object."""
    p = config_path(path)
    if not p.is_file():
        raise InputError(f"{path}: no config.json" if Path(path).is_dir() else f"{p}: no such file")
    try:
        config = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{p}: not a JSON config ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"{p}: not a JSON object")
    return config


def text_config(config: dict) -> dict:
    """The text model's config: `text_config` of a multimodal wrapper (one without its own layer count),
    else the config itself."""
    if isinstance(config.get("text_config"), dict) and "num_hidden_layers" not in config:
        return config["text_config"]
    return config
