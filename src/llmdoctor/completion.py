"""What an OpenAI-compatible endpoint answers, as both sides read it: subjects/endpoint.py's client fills a
`Completion` in (or raises `EndpointError` for a request that failed for good); the probes of
checks/endpoint/ judge them without importing the client (DESIGN.md: a check asks a subject)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import LLMDoctorError


class EndpointError(LLMDoctorError):
    """A request failed for good (after retries). `kind`: connect, timeout, http, malformed."""

    def __init__(self, kind: str, url: str, detail: str, status: int | None = None):
        self.kind, self.url, self.detail, self.status = kind, url, detail, status
        super().__init__(f"{url}: {kind}: {detail}")


@dataclass
class Completion:
    """One choice of a completion (or chat) response, streamed or not, in one shape.

    `tokens`, `token_logprobs`, `top_logprobs` are per returned token (with echo: the prompt's
    tokens first; the first prompt token's logprobs are None). `top_logprobs` maps the token's text
    to its logprob: tokens with the same text collide, the server keeps one. Where the server
    returned token ids, `token_ids` and `top_ids` hold them (no collisions) and `tokens` /
    `top_logprobs` the text of each id.
    """

    text: str
    finish_reason: str | None
    usage: dict[str, Any]
    tokens: list[str] | None = None
    token_logprobs: list[float | None] | None = None
    top_logprobs: list[dict[str, float] | None] | None = None
    elapsed: float = 0.0
    token_ids: list[int] | None = None
    top_ids: list[dict[int, float] | None] | None = None

    @property
    def has_logprobs(self) -> bool:
        return bool(self.tokens) and self.top_logprobs is not None and any(self.top_logprobs)

    def step(self, j: int) -> dict[Any, float]:
        """Step j's top log-probs keyed by token id where the server gave ids, else by text."""
        tops = self.top_ids if self.top_ids is not None else self.top_logprobs
        return (tops or [])[j] or {}
