"""The symptom steps of a probe run: the knowledge probes, then the controls that bisect a symptom
(greedy determinism and streaming, alone vs inside a concurrent ragged batch, growing positions, prefill
vs decode, and the prompt's own log-probs through echo). Each is a function of the ProbeSession."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ...completion import Completion, EndpointError
from ..metrics import topk_tail
from .answers import compare_completions, expected_stats, step_pair, top_entries
from .prompts import COUNT_PROMPT, POSITION_N, batch_requests, counting_run, knowledge_probes
from .session import ProbeAborted, ProbeSession
from .verdict import threshold


def knowledge(s: ProbeSession) -> None:
    """Counting (greedy, 3 tokens: later steps feed determinism and prefill-vs-decode), alphabet,
    copying, a fact, repetition: one step each with top-k log-probs."""
    for probe in knowledge_probes(s.seed):
        n = 3 if probe.name == "counting" else 1
        c = s.complete(f"knowledge/{probe.name}", probe.prompt, max_tokens=n, logprobs=s.k)
        if not s.with_logprobs(f"knowledge/{probe.name}", c):
            continue
        if probe.name == "counting":
            s.greedy = c
        s.answers[(probe.prompt, n)] = c
        top = c.top_logprobs[0] or {}
        s.knowledge_steps[probe.name] = c
        s.features.setdefault("top_logprobs_keys", "token ids" if c.top_ids is not None else "text")
        st = expected_stats(top, probe.expect)
        tt = topk_tail(top, top)
        metrics = {**st, "tail_mass": tt["tail_got"], "topk_entropy": tt["entropy_got"],
                   "listed": len(top), "elapsed_s": c.elapsed}
        ok = st["expected_rank"] == 1 and st["expected_logprob"] >= threshold("expected_logprob_min")
        flat = tt["tail_got"] >= threshold("flat_tail_min")
        s.find(f"knowledge/{probe.name}", "pass" if ok and not flat else "fail",
               None if ok and not flat else ("flat-distribution" if flat else "wrong-answers"),
               metrics=metrics,
               budget={"expected_logprob_min": threshold("expected_logprob_min"), "expected_rank": 1,
                       "tail_mass_max": threshold("flat_tail_min")},
               hypothesis=f"the model continues {probe.prompt[-24:]!r} with {probe.expect!r}",
               evidence=[{"prompt": probe.prompt, "expect": probe.expect, "text": c.text,
                          "top": top_entries(top, 5)}])
    s.features["logprobs"] = bool(s.knowledge_steps)
    s.features.setdefault("top_logprobs", s.k)
    if len(s.knowledge_steps) < 3:
        raise ProbeAborted("fewer than 3 knowledge probes returned log-probs")


def _compare_steps(s: ProbeSession, target: str, symptom: str, a: Completion, b: Completion | None,
                   hypothesis: str) -> None:
    """`b` must be the same answer as `a` (compare_completions)."""
    if b is None or not s.with_logprobs(target, b):
        return
    m = compare_completions(a, b)
    ok = m.pop("same")
    s.find(target, "pass" if ok else "fail", None if ok else symptom, metrics=m,
           budget={"kl_max": threshold("same_distribution_kl_max"),
                   "max_abs_dlogprob": threshold("determinism_max_abs_dlogprob")},
           hypothesis=hypothesis, evidence=[{"first": a.text, "second": b.text}])


def repeat(s: ProbeSession) -> None:
    """The greedy counting request again (determinism), then streamed (stream vs not), one at a
    time: no other request is in flight, so each answer is judged against its own request's
    (overlapping requests are the batch step's, which judges every one of them)."""
    if s.greedy is None:
        s.find("determinism", "skip", reason="the greedy counting probe did not run")
        return
    again = s.complete("determinism", COUNT_PROMPT, max_tokens=3, logprobs=s.k)
    _compare_steps(s, "determinism", "nondeterministic", s.greedy, again,
                   "the same request at temperature 0 gives the same tokens and log-probs")
    streamed = s.complete("stream", COUNT_PROMPT, max_tokens=3, logprobs=s.k, stream=True)
    _compare_steps(s, "stream", "stream-mismatch", s.greedy, streamed,
                   "streaming does not change tokens or log-probs")


def batch(s: ProbeSession) -> None:
    """`concurrency` ragged requests (batch_requests) each alone first (the knowledge probes'
    answers where they are the same request), then all in flight together, each started 50 ms after the one
    before (so each joins a batch already running and the numbering is the arrival order). Every batched answer
    is judged against its own request run alone (compare_completions); one that differs is matched against the
    other requests' answers alone, so that a completion handed to the wrong request is named as such."""
    reqs = batch_requests(s.concurrency)
    alone: list[Completion] = []
    for i, (prompt, n) in enumerate(reqs):
        c = s.answers.get((prompt, n)) or \
            s.complete(f"batch/alone/{i + 1}", prompt, max_tokens=n, logprobs=s.k)
        if not s.with_logprobs(f"batch/alone/{i + 1}", c):
            s.find("batch", "skip", reason=f"request {i + 1} alone got no answer with log-probs")
            return
        alone.append(c)
    with ThreadPoolExecutor(len(reqs)) as pool:
        futs = []
        for prompt, n in reqs:
            futs.append(pool.submit(s.ep.complete, prompt, max_tokens=n, logprobs=s.k))
            time.sleep(0.05)
        results: list[Completion | EndpointError] = []
        for f in futs:
            try:
                results.append(f.result())
            except EndpointError as e:  # also in the transport events
                results.append(e)
    rows, sentences, swapped = [], [], False
    for i, got in enumerate(results):
        row: dict[str, Any] = {"request": i + 1, "prompt": reqs[i][0][-24:], "max_tokens": reqs[i][1]}
        rows.append(row)
        if isinstance(got, EndpointError) or not got.has_logprobs:
            row["error"] = str(got) if isinstance(got, EndpointError) else "no log-probs"
            continue
        own = compare_completions(alone[i], got)
        row.update(alone=alone[i].text, batched=got.text, kl=own["kl"], max_abs_dlogprob=own["max_abs_dlogprob"],
                   own=own["same"])
        if own["same"]:
            continue
        whose = [j + 1 for j in range(len(reqs)) if j != i and compare_completions(alone[j], got)["same"]]
        row["received"] = whose
        if whose:
            swapped = True
            sentences.append(f"request {i + 1} received request {whose[0]}'s completion")
        else:
            sentences.append(f"request {i + 1}'s completion differs from its answer alone "
                             f"(KL {own['kl']:.2g}, |dlogprob| {own['max_abs_dlogprob']:.2g}, "
                             f"same text {own['same_text']})")
    judged = [r for r in rows if "own" in r]
    if not judged:
        s.find("batch", "skip", reason="no batched request got an answer with log-probs", evidence=rows)
        return
    ok = not sentences
    s.find("batch", "pass" if ok else "fail",
           None if ok else ("swapped-responses" if swapped else "batch-dependent"),
           metrics={"requests": len(reqs), "judged": len(judged), "differ": len(sentences),
                    "same_text": all(r["batched"] == r["alone"] for r in judged),
                    "kl": max(r["kl"] for r in judged),
                    "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in judged)},
           budget={"kl_max": threshold("same_distribution_kl_max"),
                   "max_abs_dlogprob": threshold("determinism_max_abs_dlogprob"), "same_text": True},
           hypothesis="every request of a concurrent ragged batch gets its own answer, the one it gets alone",
           explanation="; ".join(sentences), evidence=rows)


def positions(s: ProbeSession) -> None:
    """Counting runs of growing length: the units digit of the next number at each length."""
    rows = []
    for n in POSITION_N:
        prompt, expect = counting_run(n)
        c = s.complete(f"position/{n}", prompt, max_tokens=1, logprobs=s.k)
        if not s.with_logprobs(f"position/{n}", c):
            continue
        top = c.top_logprobs[0] or {}
        s.position_steps[n] = c
        st = expected_stats(top, expect)
        rows.append({"n": n, "prompt_tokens": c.usage.get("prompt_tokens"), **st})
    if len(rows) < 2:
        s.find("position", "skip", reason="fewer than two lengths measured")
        return
    ok = [r["expected_logprob"] >= threshold("position_logprob_min") and r["expected_rank"] == 1 for r in rows]
    if all(ok):
        status, symptom = "pass", None
    elif ok[0]:  # fine when short, wrong when long
        status, symptom = "fail", "position-dependent"
    else:
        status, symptom = "fail", "wrong-answers"
    s.find("position", status, symptom,
           metrics={"by_length": rows, "worst_logprob": min(r["expected_logprob"] for r in rows)},
           budget={"expected_logprob_min": threshold("position_logprob_min")},
           hypothesis="counting continues correctly at every length tried",
           explanation="" if status == "pass" else
           ("correct at the shortest length, wrong at longer ones" if ok[0] else "wrong at every length"))


def prefill_decode(s: ProbeSession) -> None:
    """The greedy probe's decode steps 1 and 2 against the same text sent as a prompt (one
    prefill each). An unrelated request before each one keeps a prefix cache from handing back
    the decode-time state."""
    g = s.greedy
    if g is None or not g.tokens or len(g.tokens) < 2:
        s.find("prefill-vs-decode", "skip", reason="the greedy probe produced fewer than 2 tokens")
        return
    rows, failed = [], False
    for j in range(1, min(3, len(g.tokens))):
        if s.complete("prefill-vs-decode/evict", "Hello", max_tokens=1) is None:
            continue
        text = COUNT_PROMPT + "".join(g.tokens[:j])
        c = s.complete(f"prefill-vs-decode/{j}", text, max_tokens=1, logprobs=s.k)
        if not s.with_logprobs(f"prefill-vs-decode/{j}", c):
            continue
        m = topk_tail(*step_pair(g, j, c, 0))
        failed |= not (m["kl"] <= threshold("same_distribution_kl_max") and m["top1_agree"])
        rows.append({"step": j, **m, "decode": top_entries(g.top_logprobs[j] or {}, 3),
                     "prefill": top_entries(c.top_logprobs[0] or {}, 3)})
    if not rows:
        s.find("prefill-vs-decode", "skip", reason="no prefill request succeeded")
        return
    s.find("prefill-vs-decode", "fail" if failed else "pass", "decode-only" if failed else None,
           metrics={"worst_kl": max(r["kl"] for r in rows)}, evidence=rows,
           budget={"kl_max": threshold("same_distribution_kl_max"), "top1_agree": True},
           hypothesis="a decoded token's distribution equals the one computed by prefilling the same text")


def echo(s: ProbeSession) -> None:
    """The prompt's own log-probs through `echo` (opt-in): the greedy text "1 2 ... 8 9 " sent
    back with echo. Its distributions at the greedy tokens' positions are prefill results for
    decode steps 0 and 1; every prompt position also goes to the reference comparison."""
    g = s.greedy
    if g is None or not g.tokens or len(g.tokens) < 2:
        s.find("echo", "skip", reason="the greedy probe produced fewer than 2 tokens")
        return
    text = COUNT_PROMPT + "".join(g.tokens[:2])
    try:
        c = s.ep.complete(text, max_tokens=1, echo=True, logprobs=s.k)
    except EndpointError as e:
        if e.kind == "http" and e.status in (400, 404, 422, 501):
            s.ep.events.pop()  # an unsupported feature, not a server error
            s.find("echo", "skip", reason=f"the server rejects echo with logprobs: {e.detail}")
        else:
            s.failed("echo", e)
        return
    n_prompt = len(c.tokens or []) - int(c.usage.get("completion_tokens") or 1)
    echoed, tops = (c.tokens or [])[:n_prompt], (c.top_logprobs or [])[:n_prompt]
    joined = "".join(echoed)
    n_bos = int(bool(echoed) and not text.startswith(echoed[0]) and joined[len(echoed[0]):] == text)
    if not c.has_logprobs or not (joined == text or n_bos):
        s.find("echo", "skip", reason="the server does not echo the prompt's tokens with log-probs",
               evidence=[{"text": c.text[:80], "tokens": (c.tokens or [])[:8]}])
        return
    s.features["echo"] = True
    body, body_tops = echoed[n_bos:], tops[n_bos:]  # the text's tokens, without an echoed BOS
    ids = s.server_ids.get(text) or s.tokenize(text)
    tok = s.vocab()
    if tok is not None:  # the echoed tokens against the GGUF tokenizer's pieces
        ours = tok.encode(text)
        pieces = [tok.piece(t, special=True).decode("utf-8", "replace") for t in ours]
        lead = len(ours) - len(body)
        same = lead in (0, 1) and pieces[lead:] == body
        s.find("echo/tokens", "pass" if same else "fail", None if same else "tokenizer-mismatch",
               metrics={"echoed": len(body), "ours": len(ours)},
               evidence=[] if same else [{"echoed": body[:12], "ours": pieces[:12]}],
               hypothesis="the echoed prompt tokens are the GGUF tokenizer's pieces")
        if ids is None and same:
            ids = ours
    if ids is not None and len(ids) - len(body) in (0, 1):
        lead = len(ids) - len(body)  # ids before the text's first token (BOS)
        s.echo_steps = [(f"echo/{i}", ids[:lead + i], c, n_bos + i)
                        for i, top in enumerate(body_tops) if top and lead + i > 0]
    rows, failed = [], False
    for j in (0, 1):  # greedy token j sits at echoed position n_prompt - 2 + j
        top = tops[len(echoed) - 2 + j] or {}
        m = topk_tail(*step_pair(g, j, c, len(echoed) - 2 + j))
        failed |= not (m["kl"] <= threshold("same_distribution_kl_max") and m["top1_agree"])
        rows.append({"step": j, **m, "decode": top_entries(g.top_logprobs[j] or {}, 3), "echo": top_entries(top, 3)})
    s.find("echo", "fail" if failed else "pass", "decode-only" if failed else None,
           metrics={"worst_kl": max(r["kl"] for r in rows), "prompt_positions": len(s.echo_steps),
                    "elapsed_s": c.elapsed}, evidence=rows,
           budget={"kl_max": threshold("same_distribution_kl_max"), "top1_agree": True},
           hypothesis="the prompt's own log-probs (prefill, echo) equal the greedy decode steps'")
