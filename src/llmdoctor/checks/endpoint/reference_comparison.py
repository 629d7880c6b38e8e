"""The reference step of a probe run: the probes' positions through the reference forward pass on the GGUF,
on the server's token ids, compared with the server's top-k (KL and top-1 per position, by token id where
the server gives ids, else by text)."""

from __future__ import annotations

from ...completion import Completion
from ..metrics import spearman, topk_tail
from .prompts import COUNT_PROMPT, counting_run, knowledge_probes
from .reference_logprobs import id_lookup, reference_for
from .session import ProbeSession
from .verdict import threshold


def reference(s: ProbeSession) -> None:
    """The probes' positions through the reference forward pass on the GGUF, on the server's
    token ids (the GGUF tokenizer's where the server has no tokenize route)."""
    if s.gguf is None:
        s.find("reference", "skip", reason="no --gguf given")
        return
    tok = s.vocab()
    # (name, text, the answer, its step whose top-k is the server's at the end of text)
    items = [(f"knowledge/{p.name}", p.prompt, s.knowledge_steps.get(p.name), 0)
             for p in knowledge_probes(s.seed)]
    items += [(f"position/{n}", counting_run(n)[0], c, 0) for n, c in s.position_steps.items()]
    g = s.greedy
    if g is not None and g.tokens:
        items += [(f"decode/{j}", COUNT_PROMPT + "".join(g.tokens[:j]), g, j) for j in range(1, len(g.tokens))]
    items = [it for it in items if it[2] is not None and it[2].step(it[3])]
    seqs: list[tuple[str, list[int], Completion, int]] = []
    for name, text, c, j in items:
        ids = s.server_ids.get(text)
        if name.startswith("decode/") and g.token_ids is not None and s.server_ids.get(COUNT_PROMPT):
            ids = s.server_ids[COUNT_PROMPT] + g.token_ids[:j]  # the very ids the server decoded
        if ids is None and s.features.get("tokenize_route"):
            ids = s.tokenize(text)
        if ids is None and tok is not None:
            ids = tok.encode(text)
        if ids:
            seqs.append((name, ids, c, j))
    seqs += s.echo_steps
    if not seqs or tok is None:
        s.find("reference", "skip", reason="no token ids for the probe texts")
        return
    s.progress(f"  reference forward pass on {s.gguf} ({len(seqs)} positions)")
    ref = reference_for(s.gguf)
    last = ref.last_logprobs([ids for _, ids, _, _ in seqs])
    rows, colliding = [], set()
    by_ids = all(c.top_ids is not None for _, _, c, _ in seqs)
    for name, ids, c, j in seqs:
        if by_ids:
            top = c.step(j)
            want, collisions = id_lookup(last[tuple(ids)], top), []
        else:
            top = (c.top_logprobs or [])[j] or {}
            want, collisions = ref.groups.lookup(last[tuple(ids)], top)
        colliding.update(collisions)
        m = topk_tail(top, want, want_complete=True)
        rows.append({"probe": name, "position": len(ids) - 1, "kl": m["kl"], "top1_agree": m["top1_agree"],
                     "tail_server": m["tail_got"], "tail_reference": m["tail_want"],
                     "string_collisions": collisions, "server_top": s.named_top(top),
                     "reference_top": s.named_top(want)})
    rows.sort(key=lambda r: r["position"])
    keys = "token ids" if by_ids else "text"
    note = {"top_logprobs_keys": keys, "note": "compared by token id" if by_ids else
            f"top_logprobs keyed by text: {len(colliding)} colliding pieces (each stands for more than "
            "one token id: their reference probabilities are summed, the server lists one of them)"}
    bad = [r for r in rows if r["kl"] > threshold("reference_kl_max") or not r["top1_agree"]]
    rho = spearman([r["position"] for r in rows], [r["kl"] for r in rows])
    position_dependent = bool(bad) and rows[0] not in bad and rho >= threshold("position_trend_min")
    status = "fail" if bad else "pass"
    symptom = ("position-dependent" if position_dependent else "reference-mismatch") if bad else None
    s.find("reference", status, symptom,
           metrics={"kl_max": max(r["kl"] for r in rows), "kl_mean": sum(r["kl"] for r in rows) / len(rows),
                    "top1_agreement": sum(r["top1_agree"] for r in rows) / len(rows), "positions": len(rows),
                    "kl_position_spearman": rho, "top_logprobs_keys": keys,
                    "colliding_pieces": len(colliding)},
           budget={"kl_max": threshold("reference_kl_max"), "top1_agree": True}, evidence=[note, *rows],
           hypothesis="the server's next-token distributions equal the reference forward pass on the same ids",
           explanation="" if not bad else (
                   "agrees at short positions, diverges at long ones" if position_dependent
                   else f"{len(bad)} of {len(rows)} positions differ"))
