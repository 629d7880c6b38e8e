"""The front-end steps of a probe run: the server's tokenization against the GGUF's (BOS doubled or
missing), diagnose's front-end check with the endpoint as the engine, stop sequences, and one chat turn
(EOS handling; the GGUF's chat template rendered in the sandbox against what the chat endpoint counts)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...completion import Completion, EndpointError
from ...reference.chat_template import render_chat_template
from .prompts import CHAT_MAX_TOKENS, COUNT_PROMPT, END_MARKERS, knowledge_probes
from .session import ProbeSession


def front_end(s: ProbeSession) -> None:
    tokenization(s)
    front_end_check(s)
    stop_sequence(s)
    chat(s)


def tokenization(s: ProbeSession) -> None:
    """The server's token ids (its tokenize route) against the GGUF's tokenizer with the file's
    add_bos, and the tokenize route against what the completion path counted (usage)."""
    tok = s.vocab()
    try:
        first = s.ep.tokenize(COUNT_PROMPT)
    except EndpointError as e:
        first = None
        s.find("tokenization", "skip", reason=f"tokenize request failed: {e.kind}: {e.detail}")
    s.features["tokenize_route"] = first[1] if first else None
    texts = [COUNT_PROMPT] + [p.prompt for p in knowledge_probes(s.seed)[1:]]
    if first:
        s.server_ids[COUNT_PROMPT] = first[0]
        for t in texts[1:]:
            got = s.tokenize(t)
            if got:
                s.server_ids[t] = got
    counted = (s.greedy.usage or {}).get("prompt_tokens") if s.greedy else None
    bos_text = tok.token_text(tok.bos_id) if tok is not None and tok.bos_id is not None else None
    bos_twice = s.complete("bos/literal", bos_text + "1 2 3 4", max_tokens=1) if bos_text else None
    if tok is None:
        if first and counted is not None:
            ok = counted == len(first[0])
            s.find("tokenization", "pass" if ok else "fail", None if ok else "tokenizer-mismatch",
                   metrics={"tokenize_route": len(first[0]), "completion_usage": counted},
                   hypothesis="the tokenize route and the completion path count the same tokens")
        s.find("bos", "skip", reason="needs --gguf (the file's add_bos and BOS id)")
        return
    rows, mism = [], []
    for t in texts:
        ours = tok.encode(t)
        theirs = s.server_ids.get(t)
        if theirs is None:
            continue
        same = theirs == ours
        rows.append({"text": t, "ours": len(ours), "server": len(theirs), "same": same})
        if not same:
            i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            mism.append({"text": t, "first_difference": i, "ours": ours[max(0, i - 2):i + 3],
                         "server": theirs[max(0, i - 2):i + 3]})
    # BOS: from the tokenize route where there is one, else from the completion's prompt count
    ours_count = tok.encode(COUNT_PROMPT)
    theirs = s.server_ids.get(COUNT_PROMPT)
    if theirs is not None:
        lead = sum(1 for _ in _leading(theirs, tok.bos_id))
        n_bos = lead
    elif counted is not None:
        n_bos = (1 if tok.add_bos else 0) + counted - len(ours_count)
    else:
        n_bos = None
    want_bos = 1 if tok.add_bos else 0
    evidence = {"add_bos": tok.add_bos, "bos_id": tok.bos_id, "server_leading_bos": n_bos,
                "completion_prompt_tokens": counted, "ours": len(ours_count)}
    if bos_twice is not None:
        evidence["literal_bos_prompt_tokens"] = bos_twice.usage.get("prompt_tokens")
        evidence["note"] = ("a prompt that already starts with the BOS text gets "
                            f"{bos_twice.usage.get('prompt_tokens')} tokens for '{bos_text}1 2 3 4' "
                            f"(vs {len(tok.encode('1 2 3 4'))} without it): clients must not render BOS themselves")
    if n_bos is None:
        s.find("bos", "skip", reason="the server exposes neither a tokenize route nor usage counts")
    else:
        ok = n_bos == want_bos
        s.find("bos", "pass" if ok else "fail", None if ok else "bos",
               metrics={"leading_bos": n_bos, "expected": want_bos}, evidence=[evidence],
               hypothesis="the server adds BOS exactly as the GGUF's tokenizer.ggml.add_bos_token says",
               explanation="" if ok else ("BOS doubled" if n_bos > want_bos else "BOS missing"))
    if not rows:
        s.find("tokenization", "skip", reason="the server exposes no tokenize route we know")
        return
    ok = not mism and (counted is None or counted == len(s.server_ids[COUNT_PROMPT]))
    s.find("tokenization", "pass" if ok else "fail", None if ok else "tokenizer-mismatch",
           metrics={"texts": len(rows), "mismatched": len(mism), "completion_usage": counted},
           evidence=mism or rows,
           hypothesis="the server's token ids equal the GGUF tokenizer's for every probe text")


def front_end_check(s: ProbeSession) -> None:
    """diagnose's front-end check (checks/frontend/engine.py) with the endpoint as the engine (the session's
    `front_end`, speaking through the probe's own client: one connection, one event log): its tokenize route
    (which one, and the add-special asked for, in the finding) on the same prompts, held to the GGUF's
    tokenizer."""
    from ..frontend import engine as fe

    if s.gguf is None:
        s.find("front-end", "skip", reason="needs --gguf (the reference's tokenizer)")
        return
    engine = s.front_end
    ref = fe.ReferenceFrontEnd(s.gguf, tokenizer=s.vocab())
    try:
        rows = fe.compare(engine, ref, COUNT_PROMPT)
    except EndpointError as e:
        s.find("front-end", "skip", reason=f"tokenize request failed: {e.kind}: {e.detail}")
        return
    f = fe.finding(engine, ref, rows)
    s.find("front-end", f.status, "tokenizer-mismatch" if f.status == "fail" else None,
           metrics=f.metrics, evidence=f.evidence, hypothesis=f.hypothesis, explanation=f.explanation,
           **({"reason": f.reason} if f.status == "skip" else {}))


def stop_sequence(s: ProbeSession) -> None:
    """A counting prompt with stop=["7"]: the text must end before it, finish_reason "stop"."""
    c = s.complete("stop", "1 2 3 4", max_tokens=12, stop=["7"])
    if c is None:
        return
    if "7" in c.text:
        s.find("stop", "fail", "eos-stop", evidence=[{"text": c.text, "finish_reason": c.finish_reason}],
               explanation="the output contains the stop sequence")
    elif c.finish_reason != "stop":
        s.find("stop", "skip", reason=f"the model never produced the stop sequence: {c.text!r}")
    else:
        s.find("stop", "pass", evidence=[{"text": c.text, "finish_reason": c.finish_reason}],
               hypothesis="generation stops before a stop sequence and says finish_reason=stop")


def _chat(s: ProbeSession, msgs: list[dict[str, str]]) -> Completion | None:
    """The chat turn with top log-probs; without them where the server rejects them (HTTP 400/422). A 400
    for a model without a chat template (the server says so, or the GGUF carries none) is the server
    refusing a chat it cannot format, not a server error: "no chat template: chat refused"."""
    try:
        return s.ep.chat(msgs, max_tokens=CHAT_MAX_TOKENS, logprobs=s.k)
    except EndpointError as e:
        if not (e.kind == "http" and e.status in (400, 422)):
            return s.failed("chat", e)
        s.ep.events.pop()  # feature detection, not a server error
    try:
        out = s.ep.chat(msgs, max_tokens=CHAT_MAX_TOKENS)
    except EndpointError as e:
        if e.kind == "http" and e.status == 400 and ("chat template" in e.detail.lower() or (
                s.gguf is not None and gguf_chat_template(s.gguf) is None)):
            s.ep.events.pop()
            s.find("chat", "skip", reason=f"no chat template: chat refused ({e.detail})")
            return None
        return s.failed("chat", e)
    s.fails_in_row = 0
    return out


def chat(s: ProbeSession) -> None:
    """One short greedy chat turn: EOS handling and, where the GGUF has a chat template, its
    rendering's token count against the server's.

    EOS: no end marker leaks into the text, and the turn ends by itself (finish_reason "stop").
    A turn that runs to max_tokens is a model that had more to say, unless the server's own
    log-probs show it skipped an end token: at temperature 0 every generated token must be the
    server's top-1, so a top-1 that is an end marker, or a token that renders as nothing (how
    servers show special tokens such as EOS), passed over for another token means the server
    ignores EOS (as llama.cpp's `ignore_eos` does by biasing end tokens away; llama-cpp-python
    and vLLM report log-probs before such biases). A server whose log-probs are taken after the
    bias cannot be told from a talkative model: that stays a skip, saying so."""
    msgs = [{"role": "user", "content": "Say hello."}]
    c = _chat(s, msgs)
    if c is None:
        return
    tok = s.vocab()
    markers = set(END_MARKERS)
    if tok is not None and tok.eos_id is not None:
        markers.add(tok.token_text(tok.eos_id))
    leaked = sorted(m for m in markers if m in c.text)
    skipped = _skipped_end_token(c, markers)
    ev = [{"text": c.text, "finish_reason": c.finish_reason, "usage": c.usage,
           "logprobs": c.has_logprobs, **(skipped or {})}]
    if leaked:
        s.find("eos", "fail", "eos-stop", evidence=ev, explanation=f"end markers in the output: {leaked}")
    elif c.finish_reason == "stop":
        s.find("eos", "pass", evidence=ev, hypothesis="a chat turn ends at the model's end token, "
               "which is not rendered into the text")
    elif skipped:
        s.find("eos", "fail", "eos-stop", evidence=ev, metrics={"step": skipped["step"]},
               explanation=f"the server ignores EOS: at step {skipped['step']} its own top-1 was the end "
                               f"token {skipped['top1']!r} (log-prob {skipped['top1_logprob']:.2f}), yet it "
                               f"generated {skipped['generated']!r} and ran on to finish_reason="
                               f"{c.finish_reason}")
    else:
        s.find("eos", "skip", evidence=ev, reason=(
            f"the model did not end its turn within {CHAT_MAX_TOKENS} tokens (finish_reason={c.finish_reason}) "
            + ("and no step passed over an end token in the server's log-probs" if c.has_logprobs
               else "and the server gives no chat log-probs to tell a talkative model from ignored EOS")))
    template = gguf_chat_template(s.gguf) if s.gguf is not None else None
    if s.gguf is None or tok is None:
        s.find("chat-template", "skip", reason="needs --gguf (the file's tokenizer.chat_template)")
    elif template is None:
        s.find("chat-template", "skip", reason="the GGUF carries no tokenizer.chat_template: "
               "the server's chat format cannot be checked against the model's")
    elif not c.usage.get("prompt_tokens"):
        s.find("chat-template", "skip", reason="the chat response has no usage.prompt_tokens")
    else:
        rendered = render_chat_template(template, msgs, bos=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                                        eos=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        ours = tok.encode(rendered, add_bos=tok.add_bos and not (bos_text and rendered.startswith(bos_text)),
                          parse_special=True)
        ok = len(ours) == c.usage["prompt_tokens"]
        s.find("chat-template", "pass" if ok else "fail", None if ok else "chat-template",
               metrics={"ours": len(ours), "server": c.usage["prompt_tokens"]},
               evidence=[{"rendered": rendered}],
               hypothesis="the chat endpoint's prompt is the GGUF template's rendering (same token count)")


def _skipped_end_token(c: Completion, markers: set[str]) -> dict[str, Any] | None:
    """The first step whose top-1 (in the server's own top log-probs) is an end marker or renders as
    nothing, while the server generated another token there; None if no step did."""
    for j, (gen, top) in enumerate(zip(c.tokens or [], c.top_logprobs or [])):
        if not top:
            continue
        best = max(top, key=top.get)
        if best != gen and (best == "" or best in markers):
            return {"step": j, "top1": best, "top1_logprob": top[best], "generated": gen}
    return None


def _leading(ids: list[int], bos: int | None):
    for t in ids:
        if t != bos:
            return
        yield t


def gguf_chat_template(path: Path) -> str | None:
    from ...gguf import open_gguf

    with open_gguf(path) as g:
        t = g.get("tokenizer.chat_template")
    return t if isinstance(t, str) and t else None
