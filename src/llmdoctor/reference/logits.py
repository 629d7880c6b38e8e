"""What `llmdoctor logits` reports: next-token top-K, per-position prompt logprobs, greedy steps.

Log-probabilities are computed in float64 from the run's logits (`forward.log_softmax`), so the
reported numbers do not depend on the precision of the softmax, only on the forward pass.
"""

from __future__ import annotations

from typing import Any

import torch

from .forward import ReferenceModel, log_softmax


def top_k(tok: Any, logprobs: torch.Tensor, k: int) -> list[dict]:
    """[{id, text, logprob}] of the k most likely tokens of one distribution [n_vocab]."""
    vals, idx = logprobs.topk(k)
    return [{"id": int(i), "text": tok.decode([int(i)], special=True), "logprob": float(v)}
            for v, i in zip(vals, idx)]


def report(model: ReferenceModel, tok: Any, prompt: str | None, *, top: int = 5, greedy: int = 0,
           prompt_logprobs: bool = False, add_bos: bool | None = None, ids: list[int] | None = None) -> dict:
    """Run the prompt (and `greedy` further steps) through the reference; return a JSON-ready dict.
    `ids`: the prompt as token ids, used as given instead of encoding `prompt` (models without a tokenizer)."""
    ids = list(ids) if ids is not None else tok.encode(prompt, add_bos)
    if not ids:
        from ..errors import InputError

        raise InputError("the prompt encodes to no tokens")
    logits, _ = model.forward(ids, all_logits=prompt_logprobs)
    lp = log_softmax(logits)  # [T or 1, n_vocab]
    out: dict[str, Any] = {
        "prompt": prompt,
        "tokens": [{"id": i, "text": tok.decode([i], special=True)} for i in ids],
        "next": top_k(tok, lp[-1], top),
        "stats": [s.as_dict() for s in model.stats],
    }
    if prompt_logprobs:
        # the logprob of token i given tokens < i; position 0 has no context
        out["prompt_logprobs"] = [None] + [
            {"id": ids[i], "logprob": float(lp[i - 1, ids[i]]),
             "rank": int((lp[i - 1] > lp[i - 1, ids[i]]).sum()) + 1}
            for i in range(1, len(ids))
        ]
    if greedy:
        seq, steps = list(ids), []
        step_lp = lp[-1]
        for _ in range(greedy):
            nxt = int(step_lp.argmax())
            steps.append({"id": nxt, "text": tok.decode([nxt], special=True), "logprob": float(step_lp[nxt]),
                          "top": top_k(tok, step_lp, top)})
            seq.append(nxt)
            if nxt in tok.eog_ids:
                break
            step_logits, _ = model.forward(seq, all_logits=False)
            step_lp = log_softmax(step_logits)[-1]
        out["greedy"] = {"text": tok.decode(seq[len(ids):]), "steps": steps}
    return out


def render_text(r: dict) -> str:
    """The human-readable form of `report`'s dict."""
    lines = [f"prompt: {len(r['tokens'])} tokens"]
    if "prompt_logprobs" in r:
        lines.append("prompt logprobs (token | logprob | rank):")
        for t, p in zip(r["tokens"], r["prompt_logprobs"]):
            lines.append(f"  {t['text']!r:>16} | " + ("   -    |  -" if p is None else f"{p['logprob']:8.3f} | {p['rank']}"))
    lines.append("next token:")
    lines += [f"  {c['logprob']:8.3f}  {c['text']!r} ({c['id']})" for c in r["next"]]
    if "greedy" in r:
        lines.append(f"greedy: {r['greedy']['text']!r}")
        for i, s in enumerate(r["greedy"]["steps"]):
            alts = ", ".join(f"{c['text']!r} {c['logprob']:.2f}" for c in s["top"])
            lines.append(f"  step {i}: {s['text']!r} ({s['logprob']:.3f})  top: {alts}")
    bad = [s for s in r["stats"] if s["n_inf"] or s["n_nan"]]
    if bad:
        lines.append(f"warning: inf/NaN first at layer {bad[0]['layer']} ({bad[0]['first_nonfinite']})")
    return "\n".join(lines)
