"""The reference side of the probes: the reference forward pass on the GGUF the server claims to serve, its
tokenizer, the last-position log-probs of every id sequence asked (cached per file), and those log-probs
looked up by token id or grouped by token text (as servers key top_logprobs)."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from ..metrics import grouped_logsumexp


def id_lookup(lp: Any, keys: dict[int, float]) -> dict[int, float]:
    """{id: reference log-prob} for the server's listed ids (-inf outside the reference's vocabulary)
    and the reference's most likely id. lp: [V] log-probs."""
    out = {k: float(lp[k]) if 0 <= k < len(lp) else -math.inf for k in keys}
    best = int(lp.argmax())
    out[best] = float(lp[best])
    return out


class StringGroups:
    """Reference log-probs grouped by token text: servers key top_logprobs by the detokenized
    string, so tokens with the same text are one outcome (their probabilities add up)."""

    def __init__(self, tok: Any):
        import numpy as np

        texts = [tok.piece(i, special=True).decode("utf-8", "replace") for i in range(tok.n_vocab)]
        uniq, inverse, counts = np.unique(np.array(texts, dtype=object), return_inverse=True, return_counts=True)
        self.texts = uniq.tolist()
        self.index = {s: i for i, s in enumerate(self.texts)}
        self.inverse, self.counts, self.n = inverse, counts, len(uniq)

    def lookup(self, lp: Any, keys: dict[str, float]) -> tuple[dict[str, float], list[str]]:
        """{text: log P(text)} for `keys` and the reference's most likely text; the keys that
        stand for more than one token id (collisions)."""
        logp = grouped_logsumexp(lp, self.inverse, self.n)  # [n texts]
        out = {k: float(logp[self.index[k]]) if k in self.index else -math.inf for k in keys}
        best = int(logp.argmax())
        out[self.texts[best]] = float(logp[best])
        collisions = [k for k in keys if k in self.index and self.counts[self.index[k]] > 1]
        return out, collisions


class ReferenceLogprobs:
    """The reference forward pass on one GGUF (reference/forward.py), its tokenizer, and the
    last-position log-probs of every id sequence already run: a probe run asks for prefixes of one
    counting run, and a second run on the same file (tests, a re-probe) asks for the same texts."""

    def __init__(self, path: Path):
        from ...reference.tokenizer import Tokenizer

        self.path = path
        self.tok = Tokenizer.from_gguf(path)
        self.rows: dict[tuple[int, ...], Any] = {}  # ids -> log-probs [V] float64 at the last position
        self._groups: StringGroups | None = None

    @property
    def groups(self) -> "StringGroups":
        if self._groups is None:
            self._groups = StringGroups(self.tok)
        return self._groups

    def last_logprobs(self, seqs: list[list[int]]) -> dict[tuple[int, ...], Any]:
        """{ids: log-probs [V] after ids}; one forward pass per sequence that is no prefix of a longer one."""
        from ...reference import load
        from ...reference.forward import log_softmax

        missing = [list(s) for s in {tuple(s) for s in seqs} if s not in self.rows]
        if missing:
            with load(self.path, cache=True) as model:
                for ids in sorted(missing, key=len, reverse=True):
                    if tuple(ids) in self.rows:
                        continue
                    logits, _ = model.forward(ids)  # [T, V]
                    inside = [other for other in missing if ids[:len(other)] == other]
                    # only the rows asked for (log_softmax is row by row: the same numbers as over all T rows)
                    lp = log_softmax(logits[[len(other) - 1 for other in inside]])  # [len(inside), V] float64
                    for other, row in zip(inside, lp):
                        self.rows[tuple(other)] = row
        return {tuple(s): self.rows[tuple(s)] for s in seqs}


@functools.lru_cache(maxsize=2)
def _reference_at(path: str, size: int, mtime_ns: int) -> ReferenceLogprobs:
    return ReferenceLogprobs(Path(path))


def reference_for(path: Path) -> ReferenceLogprobs:
    st = Path(path).stat()
    return _reference_at(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
