"""The `llmdoctor` command line (typer). Conventions: ../shared/DESIGN.md and README.md.

Every command: a model-file subject defaults to the demo model; `--json` prints exactly one JSON
object (the common envelope) on stdout; exit 0 passed, 1 a fault found, 2 could not run / bad input;
errors are one line on stderr (tracebacks only with --debug).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from .errors import LLMDoctorError
from .report import terminal
from .report.envelope import dumps, envelope

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="llmdoctor: find out why an LLM deployment produces garbage.",
    pretty_exceptions_enable=False,
)
check_app = typer.Typer(no_args_is_help=True, help="Run one check against its reference.")
app.add_typer(check_app, name="check")

_state = {"debug": False}


@app.callback()
def _main(debug: bool = typer.Option(False, "--debug", help="Show tracebacks on errors.")) -> None:
    _state["debug"] = debug


def model_file(path: Optional[Path]) -> Path:
    """The command's model file: the given path or the demo model."""
    if path is not None:
        return path
    from .demo import model_path

    return model_path()


def guarded(command: str) -> Callable:
    """Turn LLMDoctorError into one line on stderr (and an envelope with --json) and exit code 2."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except LLMDoctorError as e:
                if _state["debug"]:
                    raise
                terminal.error_line(str(e))
                if kwargs.get("json_out"):
                    env = envelope(command, argv=sys.argv[1:], verdict="error", exit_code=2, error=str(e))
                    print(dumps(env))
                raise typer.Exit(2) from None

        return wrapper

    return deco


@app.command()
@guarded("inspect")
def inspect(
    file: Optional[Path] = typer.Argument(None, help="GGUF file (default: the demo model)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
    tensors: bool = typer.Option(False, "--tensors", help="Include the tensor table."),
) -> None:
    """Architecture, hyperparameters, tokenizer and tensor statistics of a GGUF file."""
    from .gguf import open_gguf
    from .gguf.summary import summarize

    path = model_file(file)
    with open_gguf(path) as g:
        summary = summarize(g, tensors=tensors)
    if json_out:
        print(dumps(envelope("inspect", argv=sys.argv[1:], verdict="parsed", exit_code=0,
                             file=path, result=summary)))
    else:
        terminal.render_inspect(summary)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
