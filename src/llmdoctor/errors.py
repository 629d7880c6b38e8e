"""Errors meant for people: one line saying what is wrong and where."""

from __future__ import annotations


class LLMDoctorError(Exception):
    """Base of every error the CLI turns into a one-line message and exit code 2."""


class GGUFError(LLMDoctorError):
    """A GGUF file violates the format or a safety rule; names the problem and the file offset."""

    def __init__(self, problem: str, offset: int | None = None, path: str | None = None):
        self.problem = problem
        self.offset = offset
        self.path = path
        super().__init__(self._render())

    def _render(self) -> str:
        where = f"{self.path}: " if self.path else ""
        at = f" at offset {self.offset}" if self.offset is not None else ""
        return f"{where}{self.problem}{at}"

    def with_path(self, path: str) -> "GGUFError":
        self.path = path
        self.args = (self._render(),)
        return self


class InputError(LLMDoctorError):
    """Invalid user input (bad option value, missing file, unknown name)."""


# The engines' errors (subjects/engines/): here, below every layer, so that a check judging what an engine
# measured recognizes them without importing the engines. Not LLMDoctorError: an engine that cannot run is a
# finding ("skipped: why" or "fail"), not bad input.
class EngineError(RuntimeError):
    """The engine could not run (load failure, decode error, ABI mismatch, a crash in its child)."""


class EngineUnavailable(EngineError):
    """The engine is not usable here at all (not installed, no interpreter that imports it)."""


class NotOffered(EngineError):
    """This engine does not offer that method here; the message is why (shown as "skipped: why")."""
