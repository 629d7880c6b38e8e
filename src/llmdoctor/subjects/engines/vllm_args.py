"""The deployment's own `vllm serve` command line (`diagnose --engine vllm --engine-args "ARGS"`, issue 34).

ARGS is what follows `vllm serve`. It is split here as a shell would (shlex) and parsed in the deployment's
interpreter by vLLM's own parser (the driver's `serve_args`: the serve subcommand's make_arg_parser, its
validation, EngineArgs.from_cli_args), never re-implemented: a flag this vLLM does not know is refused in its
parser's words. The engine's runs then start vLLM with those EngineArgs (the driver's `_as_deployed` says
what llmdoctor sets over them), and each run's info carries the resolved configuration beside vLLM's defaults
for the same model (`engine_config`).
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ...errors import EngineError, InputError


@dataclass(frozen=True)
class ServeArgs:
    """A deployment's serve arguments as vLLM parsed them."""

    argv: tuple[str, ...]
    model: Path | None  # the model they name (absolute), None: none named
    tokenizer: Path | None  # the tokenizer folder they name (absolute), None: the model's own


def split(text: str) -> list[str]:
    """ARGS as the shell splits them; a pasted leading `vllm serve` is dropped."""
    try:
        argv = shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise InputError(f"--engine-args {text!r}: {e}") from None
    return argv[2:] if argv[:2] == ["vllm", "serve"] else argv


def parse(text: str, query: Callable[[dict], dict]) -> ServeArgs:
    """`text` parsed by vLLM's serve parser in the deployment's interpreter (`query`: a request to its driver,
    vllm.py's), relative paths taken from this directory. InputError quoting vLLM where it refuses them (an
    unknown flag, a bad value, a named model that is no local file or folder)."""
    argv = split(text)
    try:
        got = query({"command": "serve_args", "engine_args": argv, "cwd": os.getcwd()})
    except EngineError as e:
        raise InputError(f"--engine-args: {str(e).removeprefix('ArgsRefused: ')}") from None
    return ServeArgs(tuple(argv), None if got["model"] is None else Path(got["model"]),
                     None if got["tokenizer"] is None else Path(got["tokenizer"]))
