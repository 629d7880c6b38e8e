"""Finding: one hypothesis with its evidence and verdict. Every check reports through it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]


@dataclass
class Finding:
    """One measured (or skipped) hypothesis. A skip always carries its reason; it never reads as a pass."""

    check: str  # e.g. "dequant"
    subject: str  # what was measured: a kernel, an engine, an endpoint
    target: str  # what it was measured on: a tensor, a case, a probe
    status: Status
    reason: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    budget: dict[str, Any] = field(default_factory=dict)
    explanation: str = ""
    evidence: list[Any] = field(default_factory=list)
    id: str = ""
    hypothesis: str = ""  # the question this finding answers, in words
    confidence: str = ""  # "high" | "medium" | "low" for a verdict that rests on indirect evidence
    # diagnose: the plan's hypothesis (its key) this finding answers; a sub-check's finding keeps its own check
    # and id (a front-end fault found under "metadata", a probe under "symptom-bisection"); empty elsewhere
    step: str = ""

    def __post_init__(self) -> None:
        if self.status not in ("pass", "fail", "skip"):
            raise ValueError(f"bad status {self.status!r}")
        if self.status == "skip" and not self.reason:
            raise ValueError("a skipped finding must say why")
        if not self.id:
            self.id = f"{self.check}/{self.subject}/{self.target}"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        if not self.step:
            del out["step"]  # outside diagnose
        return out


def count(findings: list[Finding]) -> dict[str, int]:
    """passed / failed / skipped, reported separately."""
    c = {"passed": 0, "failed": 0, "skipped": 0}
    for f in findings:
        c[{"pass": "passed", "fail": "failed", "skip": "skipped"}[f.status]] += 1
    return c


def exit_code(findings: list[Finding], *, required_ran: bool = True) -> int:
    """0 all requested checks ran and passed; 1 a failure; 2 nothing could be compared."""
    c = count(findings)
    if c["failed"]:
        return 1
    if not required_ran or c["passed"] == 0:
        return 2
    return 0
