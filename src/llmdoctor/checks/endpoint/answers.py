"""Reading and comparing the server's answers: one step's top-k keyed alike, two answers to the same greedy
request (same text, each step's KL, the chosen tokens' log-probs), and the expected continuation's rank."""

from __future__ import annotations

from typing import Any

from ...completion import Completion
from ..metrics import logsumexp, topk_tail
from .verdict import threshold


def step_pair(a: Completion, ja: int, b: Completion, jb: int) -> tuple[dict[Any, float], dict[Any, float]]:
    """Step ja of `a` and step jb of `b`, both keyed by token id where both answers carry ids, else by text."""
    if a.top_ids is not None and b.top_ids is not None:
        return a.step(ja), b.step(jb)
    return (a.top_logprobs or [])[ja] or {}, (b.top_logprobs or [])[jb] or {}


def compare_completions(a: Completion, b: Completion) -> dict[str, Any]:
    """Two answers to the same greedy request: same text, each step's top-k + tail KL
    (metrics.topk_tail, by token id where both have ids) and the chosen tokens' |delta log-prob|,
    against the same-distribution and determinism thresholds. (Not every listed log-prob: the
    unlikely ones move by 0.17 nats on a healthy server when the prompt cache changes the batch
    split, while the KL moves by 6e-4.)"""
    n = min(len(a.top_logprobs or []), len(b.top_logprobs or []))
    steps = [topk_tail(*reversed(step_pair(a, j, b, j))) for j in range(n)]
    kls = [m["kl"] for m in steps]
    chosen = [abs(x - y) for x, y in zip(a.token_logprobs or [], b.token_logprobs or [])
              if x is not None and y is not None]
    worst_kl, worst_d = max(kls, default=0.0), max(chosen, default=0.0)
    same_text, top1 = a.text == b.text, all(m["top1_agree"] for m in steps)
    return {"kl": worst_kl, "max_abs_dlogprob": worst_d, "kl_per_step": kls, "same_text": same_text,
            "top1_agree": top1, "same": same_text and top1 and worst_kl <= threshold("same_distribution_kl_max")
            and worst_d <= threshold("determinism_max_abs_dlogprob")}


def expected_stats(top: dict[str, float], expect: str) -> dict[str, Any]:
    """Log-prob and rank of the expected continuation in one step's top-k (keyed by token text).

    Every listed token that is a non-empty prefix of `expect` is a way to start it: their
    probabilities add up (a lower bound of the continuation's first-step mass). Rank is 1-based
    among the listed tokens; None when no listed token starts the continuation.
    """
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    hits = [(i + 1, lp) for i, (tok, lp) in enumerate(ranked) if tok and expect.startswith(tok)]
    return {"expected_logprob": logsumexp([v for _, v in hits]), "expected_rank": hits[0][0] if hits else None,
            "top1": ranked[0][0] if ranked else None}


def top_entries(d: dict[Any, float], n: int) -> list[list[Any]]:
    """The n most likely entries of a step, [key, log-prob rounded to 4 places]."""
    return [[k, round(v, 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]
