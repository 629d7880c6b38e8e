"""What a subject run in an isolated child answers, as both sides read it: subjects/ runs the subject
and fills these in (subjects/isolation.py, the kernel clients of subjects/kernels.py and
subjects/attention.py); checks/ judges them, without starting any subject itself (DESIGN.md,
"Subjects are isolated").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Outcome:
    """What happened to one call. status: ok | raised | crashed | timeout (the handler's own reply
    header may carry a finer status, e.g. 'unsupported')."""

    status: str
    message: str = ""
    header: dict[str, Any] = field(default_factory=dict)
    payload: bytearray = field(default_factory=bytearray)
    seconds: float = 0.0


class LoadFailed(Exception):
    """The child could not build its handler: `kind` is the exception's class name, `args[0]` its message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class AttentionReply:
    """One attention contract call as the check receives it: `out` [Tq, H, Dv] and `lse` [H, Tq] (None:
    the kernel returns none) on the device of the case's inputs."""

    status: str  # ok | unsupported | raised | crashed | timeout | contract | transport
    message: str = ""
    out: Optional[Any] = None  # torch.Tensor
    lse: Optional[Any] = None  # torch.Tensor
    seconds: float = 0.0
