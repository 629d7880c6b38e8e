"""What the probe steps share: the endpoint client and its front end as an engine (both opened by the
caller), the answers gathered so far, the findings, and the plumbing every request goes through (a
failure becomes a skip; too many in a row end the run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ...completion import Completion, EndpointError
from ..base import Finding
from .answers import top_entries
from .reference_logprobs import reference_for
from .verdict import probe_finding, threshold


class ProbeAborted(Exception):
    """Too many requests failed in a row: stop probing."""


class ProbeSession:
    """One probe run's state. `ep`: an endpoint client (subjects/endpoint.py's Endpoint: complete, chat,
    tokenize, piece, resolve_model, events, n_requests); `front_end`: the same endpoint as an engine for
    the front-end check (subjects/engines/endpoint.py's EndpointEngine speaking through `ep`)."""

    def __init__(self, ep: Any, front_end: Any, *, gguf: Path | None = None, concurrency: int = 4, seed: int = 0,
                 progress: Callable[[str], None] | None = None):
        self.ep, self.front_end = ep, front_end
        self.gguf, self.concurrency, self.seed = gguf, max(2, concurrency), seed
        self.progress = progress or (lambda msg: None)
        self.k = threshold("top_k")
        self.findings: list[Finding] = []
        self.features: dict[str, Any] = {}
        self.fails_in_row = 0
        self.subject = ep.base
        self.greedy: Completion | None = None  # the counting probe, 3 greedy tokens
        self.answers: dict[tuple[str, int], Completion] = {}  # (prompt, max_tokens) -> knowledge answer
        self.knowledge_steps: dict[str, Completion] = {}  # probe -> its answer (step 0: the probe's top-k)
        self.position_steps: dict[int, Completion] = {}  # counting-run length -> its answer (step 0)
        self.server_ids: dict[str, list[int]] = {}  # text -> the server's token ids
        self.echo_steps: list[tuple[str, list[int], Completion, int]] = []  # (name, ids before, echo, step)
        if gguf is not None:  # the ids' text from the file's vocabulary (the tokenization step checks it is the server's)
            ep.pieces = self.piece

    def find(self, target: str, status: str, symptom: str | None = None, **kw: Any) -> Finding:
        f = probe_finding(self.subject, target, status, symptom, **kw)
        self.findings.append(f)
        return f

    def failed(self, what: str, e: EndpointError) -> None:
        self.fails_in_row += 1
        self.find(what, "skip", reason=f"request failed: {e.kind}: {e.detail}")
        if self.fails_in_row >= threshold("max_consecutive_failures"):
            raise ProbeAborted(str(e)) from None

    def complete(self, what: str, prompt: str, **kw: Any) -> Completion | None:
        """A completion; with `logprobs`, a server that rejects k (HTTP 400/422: OpenAI allows 5)
        is asked again with 5, then 1 (feature detection, not a server error)."""
        while True:
            try:
                out = self.ep.complete(prompt, **kw)
            except EndpointError as e:
                smaller = [k for k in (5, 1) if k < (kw.get("logprobs") or 0)]
                if not (e.kind == "http" and e.status in (400, 422) and smaller):
                    return self.failed(what, e)
                self.ep.events.pop()
                self.k = kw["logprobs"] = smaller[0]
                self.features["top_logprobs"] = self.k
                continue
            self.fails_in_row = 0
            return out

    def tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for `text`, None when its tokenize route fails or is missing."""
        try:
            got = self.ep.tokenize(text)
        except EndpointError:
            return None  # already in the transport events
        return got[0] if got else None

    def with_logprobs(self, what: str, c: Completion | None) -> bool:
        if c is None:
            return False
        if not c.has_logprobs:
            self.find(what, "fail", "missing-logprobs", reason="",
                      explanation="the server returned no top log-probs for a request that asked for them",
                      evidence=[{"text": c.text, "finish_reason": c.finish_reason}])
            return False
        return True

    def vocab(self) -> Any:
        """The GGUF's tokenizer (reference/tokenizer.py), or None without --gguf."""
        return reference_for(self.gguf).tok if self.gguf is not None else None

    def named_top(self, d: dict[Any, float]) -> list[list[Any]]:
        """The 3 most likely entries of a step; an id is shown with its text."""
        return [[k, self.ep.piece(k), v] if isinstance(k, int) else [k, v] for k, v in top_entries(d, 3)]

    def piece(self, token_id: int) -> str | None:
        """The text of a token id in the GGUF's vocabulary (special tokens as their text, as servers
        key them); None outside it."""
        tok = self.vocab()
        return tok.piece(token_id, special=True).decode("utf-8", "replace") if 0 <= token_id < tok.n_vocab else None
