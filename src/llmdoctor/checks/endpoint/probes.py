"""`llmdoctor probe`: black-box examination of a live OpenAI-compatible endpoint.

What a user can see from outside is text and top-k log-probs. The probes turn that into evidence:

- knowledge: counting, alphabet, copying a random string, a short fact, repetition. For each, the
  log-prob and rank of the expected continuation (every listed token that is a prefix of it counts,
  so the probe does not depend on one tokenizer) and the top-k + tail entropy (a flat distribution
  is the garbage signature).
- symptom bisection: greedy determinism (the same request again), streamed vs not, alone vs inside
  a concurrent ragged batch, growing positions (a counting run of growing length: the units digit
  needs the right relative positions), prefill vs decode (the distribution of a decoded token
  against the same text sent as a prompt; with the opt-in "echo" step also against the prompt's
  own log-probs, which llama-cpp-python computes at ~1.8 s a prompt token).
- front end: the server's tokenization against the GGUF's (BOS doubled or missing), the GGUF's chat
  template rendered in a sandboxed jinja2 environment against what the chat endpoint tokenizes, stop
  sequences and EOS handling.
- with the GGUF the server claims to serve: the same token ids through the reference forward pass;
  KL and top-1 agreement per probe position (and per echoed prompt position) through
  `metrics.topk_tail`, after checking the server's tokenization against the GGUF's.

Tokens are compared by id where the server returns log-probs keyed by token id (every request asks,
subjects/endpoint.py; vLLM honours it), else by decoded text, where tokens of the same text collide:
the reference finding then says how many of the listed pieces stand for more than one id.

Every threshold is in `THRESHOLDS` with its derivation; the report shows them. A server that errors,
times out, returns malformed JSON or omits logprobs is never called healthy.
"""

from __future__ import annotations

import functools
import math
import random
import string
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ...errors import InputError
from ...reference.chat_template import render_chat_template
from ...subjects.endpoint import Completion, Endpoint, EndpointError
from ..base import Finding
from ..metrics import grouped_logsumexp, logsumexp, spearman, topk_tail

# ---------------------------------------------------------------------------------------------
# thresholds, derived from what the healthy llama-cpp-python 0.3.36 server measures here with the
# demo model (Gemma 3 270M Q4_K_M); every number quoted is in bench/RESULTS.md ("Endpoint probe" and
# "Endpoint probe, session 3"), measured with bench/probe_noise_floor.py unless a test is named.
THRESHOLDS: dict[str, dict[str, Any]] = {
    "top_k": {"value": 10, "why": "top-10 log-probs per token: enough to rank the expected token and to "
                                  "see a flat distribution; llama-cpp-python costs the same for any k"},
    "expected_logprob_min": {"value": -1.0, "why": "healthy: the worst knowledge probe (the fact) gives "
        "-0.30; the server's top-1 log-prob differs from the reference forward pass's by at most 0.045 at "
        "the probe positions, so a healthy deployment of this file stays near -0.35; -1.0 leaves 0.65 "
        "nats (15x that difference) for another engine's arithmetic. The expected continuation must also "
        "rank first"},
    "garbage_fraction": {"value": 0.5, "why": "more than half of the knowledge probes wrong is garbage; "
        "one or two wrong is degraded"},
    "flat_tail_min": {"value": 0.5, "why": "healthy: the top-10 tail mass is <= 0.054 on every "
        "knowledge probe (copy 0.054, fact 0.046); a tail of half the mass or more is a flat distribution"},
    "determinism_max_abs_dlogprob": {"value": 0.05, "why": "the chosen tokens' log-probs of the same "
        "greedy request: healthy differences up to 8.8e-3 nats when the prompt cache holds only a "
        "short shared prefix (the rest is one prefill batch of another size), 0 with a cold or warm "
        "cache, streamed or not; 8.8e-3 too between a request alone and inside a concurrent batch of 4. "
        "0.05 is ~6x that, below the up-to-0.3-nat jitter of the nondeterministic fault (tests/test_probe.py)"},
    "same_distribution_kl_max": {"value": 5e-3, "why": "the same distribution computed twice (top-10 + "
        "tail KL): repeated, streamed, alone vs batched, prefill vs decode. healthy: 0 with a cold or "
        "warm cache, 6.4e-4 with a short shared prefix cached, 6.7e-4 alone vs in a concurrent batch of 4, "
        "1.1e-4 to 3.2e-4 echo (one prefill batch) vs decode steps; 5e-3 is ~8x the largest (the "
        "decode-perturb and crosstalk faults exceed it: tests/test_probe.py)"},
    "position_logprob_min": {"value": math.log(0.5), "why": "the units digit of a counting run is "
        "certain for a healthy model (-0.024 at 12 numbers, -1.5e-3 to -7e-5 at 33 to 75); requiring half "
        "the mass (-0.69) is 30x looser than the worst healthy, while a rope base of 100 instead of 1e6 "
        "gives -2.12 at 54 numbers"},
    "reference_kl_max": {"value": 0.1, "why": "healthy server vs reference (float32, same GGUF, "
        "top-10 + tail): KL max 2.0e-2 (an echoed prompt position where the model hesitates between "
        "two tokens), mean 1.8e-3 over 29 positions; 6.0e-3 at the probes' own 11 positions. 0.1 is 5x "
        "the healthy max, while attention block scales perturbed give KL up to 2.49 and a rope base of "
        "100 gives up to 2.1 (at position 154)"},
    "position_trend_min": {"value": 0.6, "why": "reference mismatches are position-dependent when the "
        "shortest position agrees and KL rises with position: Spearman rank correlation >= 0.6, about "
        "the two-sided 5% critical value for the ~11 positions probed (0.62 at n=11). Rope base 100 "
        "instead of 1e6 measures 0.78-0.81"},
    "max_consecutive_failures": {"value": 3, "why": "stop probing (verdict inconclusive) after 3 "
        "requests in a row failed for good: the rest would only wait for timeouts"},
}


def _t(name: str) -> Any:
    return THRESHOLDS[name]["value"]


# Symptom classes a finding can carry (the verdict lists those found, with the findings' ids).
SYMPTOMS = {
    "unreachable": "the server could not be reached",
    "timeout": "requests timed out",
    "malformed-json": "responses were not valid JSON or lacked required fields",
    "server-errors": "the server answered with HTTP errors (even where a retry recovered)",
    "missing-logprobs": "the server returned no log-probs: nothing can be measured",
    "wrong-answers": "easy continuations (counting, alphabet, copying, facts) are not predicted",
    "flat-distribution": "the next-token distribution is flat: the garbage signature",
    "nondeterministic": "the same greedy request gives different results",
    "stream-mismatch": "streamed and non-streamed results differ",
    "batch-dependent": "results change when the request shares a batch with others",
    "swapped-responses": "a request received the completion of another request in flight",
    "position-dependent": "results degrade with the position in the sequence (RoPE / long context)",
    "decode-only": "decoded tokens' distributions differ from the same text prefilled",
    "tokenizer-mismatch": "the server tokenizes differently from the GGUF's tokenizer",
    "bos": "BOS doubled or missing",
    "chat-template": "the chat endpoint formats messages differently from the GGUF's template",
    "eos-stop": "generation does not stop at EOS or at a stop sequence",
    "reference-mismatch": "the server's distributions differ from the reference forward pass",
}


@dataclass(frozen=True)
class Knowledge:
    name: str
    prompt: str
    expect: str  # the continuation; any listed token that is a prefix of it counts


COUNT_PROMPT = "1 2 3 4 5 6 7 8 "
# Texts of end-of-turn / end-of-text tokens (Gemma, Llama 2, ChatML, Llama 3, GPT-2 style) that must
# never be rendered into a reply; llama.cpp (llama-vocab.cpp) also stops generation at these.
END_MARKERS = ("<eos>", "</s>", "<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")
CHAT_MAX_TOKENS = 16
POSITION_N = (12, 33, 54, 75)  # counting runs 1..N, then the tens digit of N+1; the units digit is expected
_COPY_ALPHABET = string.ascii_letters + string.digits


def counting_run(n: int) -> tuple[str, str]:
    """("1 2 ... n d", units digit of n+1) where d is the tens digit of n+1 (n >= 9)."""
    nxt = str(n + 1)
    return " ".join(str(i) for i in range(1, n + 1)) + " " + nxt[:-1], nxt[-1]


def batch_requests(n: int) -> list[tuple[str, int]]:
    """The `n` requests of the concurrent ragged batch, (prompt, max_tokens): the prompts differ in
    text and length, so each answer belongs to one request only, and every continuation is certain
    for a healthy model (counting, the alphabet, a repeated sentence), so a greedy text that
    changes is a fault, not a near tie. The first three are knowledge probes, whose answers alone
    the probe already has. Output lengths are ragged but short: llama-cpp-python spends ~0.3-1 s
    of Python per generated token when log-probs are asked (it sorts the whole vocabulary).
    Beyond the first four: counting runs from 100, 200, ..."""
    know = {p.name: p.prompt for p in knowledge_probes(0)}
    fixed = [(know["counting"], 3), (know["alphabet"], 1), (know["repetition"], 1), (counting_run(20)[0] + "1", 2)]
    more = [(" ".join(str(100 * i + j) for j in range(4 + i % 5)) + " ", 1 + i % 3) for i in range(1, n)]
    return (fixed + more)[:n]


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
            "top1_agree": top1, "same": same_text and top1 and worst_kl <= _t("same_distribution_kl_max")
            and worst_d <= _t("determinism_max_abs_dlogprob")}


def knowledge_probes(seed: int) -> list[Knowledge]:
    rnd = random.Random(seed)
    word = "".join(rnd.choice(_COPY_ALPHABET) for _ in range(5))
    return [
        Knowledge("counting", COUNT_PROMPT, "9"),
        Knowledge("alphabet", "A B C D E F G", " H"),
        Knowledge("copy", f"Copy the text exactly.\nText: qz7Vk\nCopy: qz7Vk\nText: {word}\nCopy: {word[:2]}",
                  word[2:]),
        Knowledge("fact", "Paris is the capital of", " France"),
        Knowledge("repetition", "the cat sat on the mat. the cat sat on the", " mat"),
    ]


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


@dataclass
class ProbeReport:
    url: str
    model: str | None
    verdict: str  # healthy | degraded | garbage | inconclusive
    findings: list[Finding]
    symptoms: dict[str, list[str]]  # class -> ids of the findings that show it
    features: dict[str, Any]
    wall_s: float
    n_requests: int
    transport_events: list[dict[str, Any]]
    thresholds: dict[str, dict[str, Any]] = field(default_factory=lambda: THRESHOLDS)

    @property
    def exit_code(self) -> int:
        return {"healthy": 0, "degraded": 1, "garbage": 1}.get(self.verdict, 2)

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "model": self.model, "verdict": self.verdict, "symptoms": self.symptoms,
                "features": self.features, "wall_s": self.wall_s, "n_requests": self.n_requests,
                "transport_events": self.transport_events, "thresholds": self.thresholds}


# The probe steps in the order they run (each a Prober method); "knowledge" always runs first.
# "echo" is opt-in: prompt log-probs cost llama-cpp-python ~1.8 s per prompt token.
STEPS = {"knowledge": "knowledge probes", "repeat": "determinism and streaming",
         "batch": "concurrent ragged batch", "positions": "positions", "prefill_decode": "prefill vs decode",
         "echo": "prompt log-probs (echo)", "front_end": "front end", "reference": "reference"}
DEFAULT_STEPS = tuple(s for s in STEPS if s != "echo")


class _Abort(Exception):
    """Too many requests failed in a row: stop probing."""


class Prober:
    """Runs the probes against one endpoint; `run()` returns the report."""

    def __init__(self, ep: Endpoint, *, gguf: Path | None = None, concurrency: int = 4, seed: int = 0,
                 progress: Callable[[str], None] | None = None, steps: Iterable[str] | None = None):
        unknown = set(steps or ()) - set(STEPS)
        if unknown:
            raise InputError(f"unknown probe steps {sorted(unknown)}; known: {', '.join(STEPS)}")
        wanted = DEFAULT_STEPS if steps is None else set(steps)
        self.steps = ["knowledge", *[s for s in STEPS if s != "knowledge" and s in wanted]]
        self.ep, self.gguf, self.concurrency, self.seed = ep, gguf, max(2, concurrency), seed
        self.progress = progress or (lambda msg: None)
        self.k = _t("top_k")
        self.findings: list[Finding] = []
        self.features: dict[str, Any] = {}
        self._fails_in_row = 0
        self.subject = ep.base
        self.greedy: Completion | None = None  # the counting probe, 3 greedy tokens
        self.answers: dict[tuple[str, int], Completion] = {}  # (prompt, max_tokens) -> knowledge answer
        self.knowledge_steps: dict[str, Completion] = {}  # probe -> its answer (step 0: the probe's top-k)
        self.position_steps: dict[int, Completion] = {}  # counting-run length -> its answer (step 0)
        self.server_ids: dict[str, list[int]] = {}  # text -> the server's token ids
        self.echo_steps: list[tuple[str, list[int], Completion, int]] = []  # (name, ids before, echo, step)
        if gguf is not None:  # the ids' text from the file's vocabulary (the tokenization step checks it is the server's)
            ep.pieces = self._piece

    # -- plumbing --------------------------------------------------------------------------

    def _find(self, target: str, status: str, symptom: str | None = None, **kw: Any) -> Finding:
        metrics = dict(kw.pop("metrics", {}))
        if symptom:
            metrics["symptom"] = symptom
        f = Finding("probe", self.subject, target, status, metrics=metrics, **kw)
        self.findings.append(f)
        return f

    def _req(self, what: str, fn: Callable[..., Completion], *a: Any, **kw: Any) -> Completion | None:
        """One request; a failure (after the client's retries) becomes a skip of `what`."""
        try:
            out = fn(*a, **kw)
        except EndpointError as e:
            return self._failed(what, e)
        self._fails_in_row = 0
        return out

    def _failed(self, what: str, e: EndpointError) -> None:
        self._fails_in_row += 1
        self._find(what, "skip", reason=f"request failed: {e.kind}: {e.detail}")
        if self._fails_in_row >= _t("max_consecutive_failures"):
            raise _Abort(str(e)) from None

    def _complete(self, what: str, prompt: str, **kw: Any) -> Completion | None:
        """A completion; with `logprobs`, a server that rejects k (HTTP 400/422: OpenAI allows 5)
        is asked again with 5, then 1 (feature detection, not a server error)."""
        while True:
            try:
                out = self.ep.complete(prompt, **kw)
            except EndpointError as e:
                smaller = [k for k in (5, 1) if k < (kw.get("logprobs") or 0)]
                if not (e.kind == "http" and e.status in (400, 422) and smaller):
                    return self._failed(what, e)
                self.ep.events.pop()
                self.k = kw["logprobs"] = smaller[0]
                self.features["top_logprobs"] = self.k
                continue
            self._fails_in_row = 0
            return out

    def _tokenize(self, text: str) -> list[int] | None:
        """The server's token ids for `text`, None when its tokenize route fails or is missing."""
        try:
            got = self.ep.tokenize(text)
        except EndpointError:
            return None  # already in the transport events
        return got[0] if got else None

    def _with_logprobs(self, what: str, c: Completion | None) -> bool:
        if c is None:
            return False
        if not c.has_logprobs:
            self._find(what, "fail", "missing-logprobs", reason="",
                       explanation="the server returned no top log-probs for a request that asked for them",
                       evidence=[{"text": c.text, "finish_reason": c.finish_reason}])
            return False
        return True

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> ProbeReport:
        t0 = time.perf_counter()
        try:
            self.progress(f"probing {self.ep.base}")
            self.ep.resolve_model()
            self.features["model"] = self.ep.model
            for name in self.steps:
                self.progress(f"  {STEPS[name]} ({time.perf_counter() - t0:.0f} s)")
                getattr(self, name)()
            aborted = None
        except (_Abort, EndpointError) as e:
            aborted = str(e)
            if isinstance(e, EndpointError):
                self._find("connect", "fail", "unreachable" if e.kind == "connect" else None,
                           explanation=f"could not start probing: {e}")
        self._transport()
        verdict, symptoms = self._verdict(aborted)
        wall = time.perf_counter() - t0
        self.progress(f"verdict {verdict} after {wall:.0f} s, {self.ep.n_requests} requests")
        return ProbeReport(self.ep.base, self.ep.model, verdict, self.findings, symptoms, self.features,
                           wall, self.ep.n_requests, list(self.ep.events))

    # -- knowledge -------------------------------------------------------------------------

    def knowledge(self) -> None:
        """Counting (greedy, 3 tokens: later steps feed determinism and prefill-vs-decode), alphabet,
        copying, a fact, repetition: one step each with top-k log-probs."""
        for probe in knowledge_probes(self.seed):
            n = 3 if probe.name == "counting" else 1
            c = self._complete(f"knowledge/{probe.name}", probe.prompt, max_tokens=n, logprobs=self.k)
            if not self._with_logprobs(f"knowledge/{probe.name}", c):
                continue
            if probe.name == "counting":
                self.greedy = c
            self.answers[(probe.prompt, n)] = c
            top = c.top_logprobs[0] or {}
            self.knowledge_steps[probe.name] = c
            self.features.setdefault("top_logprobs_keys", "token ids" if c.top_ids is not None else "text")
            st = expected_stats(top, probe.expect)
            tt = topk_tail(top, top)
            metrics = {**st, "tail_mass": tt["tail_got"], "topk_entropy": tt["entropy_got"],
                       "listed": len(top), "elapsed_s": c.elapsed}
            ok = st["expected_rank"] == 1 and st["expected_logprob"] >= _t("expected_logprob_min")
            flat = tt["tail_got"] >= _t("flat_tail_min")
            self._find(f"knowledge/{probe.name}", "pass" if ok and not flat else "fail",
                       None if ok and not flat else ("flat-distribution" if flat else "wrong-answers"),
                       metrics=metrics,
                       budget={"expected_logprob_min": _t("expected_logprob_min"), "expected_rank": 1,
                               "tail_mass_max": _t("flat_tail_min")},
                       hypothesis=f"the model continues {probe.prompt[-24:]!r} with {probe.expect!r}",
                       evidence=[{"prompt": probe.prompt, "expect": probe.expect, "text": c.text,
                                  "top": _top(top, 5)}])
        self.features["logprobs"] = bool(self.knowledge_steps)
        self.features.setdefault("top_logprobs", self.k)
        if len(self.knowledge_steps) < 3:
            raise _Abort("fewer than 3 knowledge probes returned log-probs")

    # -- determinism and streaming --------------------------------------------------------------

    def _compare_steps(self, target: str, symptom: str, a: Completion, b: Completion | None,
                       hypothesis: str) -> None:
        """`b` must be the same answer as `a` (compare_completions)."""
        if b is None or not self._with_logprobs(target, b):
            return
        m = compare_completions(a, b)
        ok = m.pop("same")
        self._find(target, "pass" if ok else "fail", None if ok else symptom, metrics=m,
                   budget={"kl_max": _t("same_distribution_kl_max"),
                           "max_abs_dlogprob": _t("determinism_max_abs_dlogprob")},
                   hypothesis=hypothesis, evidence=[{"first": a.text, "second": b.text}])

    def repeat(self) -> None:
        """The greedy counting request again (determinism), then streamed (stream vs not), one at a
        time: no other request is in flight, so each answer is judged against its own request's
        (overlapping requests are the batch step's, which judges every one of them)."""
        if self.greedy is None:
            self._find("determinism", "skip", reason="the greedy counting probe did not run")
            return
        again = self._complete("determinism", COUNT_PROMPT, max_tokens=3, logprobs=self.k)
        self._compare_steps("determinism", "nondeterministic", self.greedy, again,
                            "the same request at temperature 0 gives the same tokens and log-probs")
        streamed = self._complete("stream", COUNT_PROMPT, max_tokens=3, logprobs=self.k, stream=True)
        self._compare_steps("stream", "stream-mismatch", self.greedy, streamed,
                            "streaming does not change tokens or log-probs")

    # -- batch ---------------------------------------------------------------------------------

    def batch(self) -> None:
        """`concurrency` ragged requests (batch_requests) each alone first (the knowledge probes'
        answers where they are the same request), then all in flight together, each started 50 ms after the one
        before (so each joins a batch already running and the numbering is the arrival order). Every batched answer
        is judged against its own request run alone (compare_completions); one that differs is matched against the
        other requests' answers alone, so that a completion handed to the wrong request is named as such."""
        reqs = batch_requests(self.concurrency)
        alone: list[Completion] = []
        for i, (prompt, n) in enumerate(reqs):
            c = self.answers.get((prompt, n)) or \
                self._complete(f"batch/alone/{i + 1}", prompt, max_tokens=n, logprobs=self.k)
            if not self._with_logprobs(f"batch/alone/{i + 1}", c):
                self._find("batch", "skip", reason=f"request {i + 1} alone got no answer with log-probs")
                return
            alone.append(c)
        with ThreadPoolExecutor(len(reqs)) as pool:
            futs = []
            for prompt, n in reqs:
                futs.append(pool.submit(self.ep.complete, prompt, max_tokens=n, logprobs=self.k))
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
            self._find("batch", "skip", reason="no batched request got an answer with log-probs", evidence=rows)
            return
        ok = not sentences
        self._find("batch", "pass" if ok else "fail",
                   None if ok else ("swapped-responses" if swapped else "batch-dependent"),
                   metrics={"requests": len(reqs), "judged": len(judged), "differ": len(sentences),
                            "same_text": all(r["batched"] == r["alone"] for r in judged),
                            "kl": max(r["kl"] for r in judged),
                            "max_abs_dlogprob": max(r["max_abs_dlogprob"] for r in judged)},
                   budget={"kl_max": _t("same_distribution_kl_max"),
                           "max_abs_dlogprob": _t("determinism_max_abs_dlogprob"), "same_text": True},
                   hypothesis="every request of a concurrent ragged batch gets its own answer, the one it gets alone",
                   explanation="; ".join(sentences), evidence=rows)

    # -- positions -------------------------------------------------------------------------

    def positions(self) -> None:
        """Counting runs of growing length: the units digit of the next number at each length."""
        rows = []
        for n in POSITION_N:
            prompt, expect = counting_run(n)
            c = self._complete(f"position/{n}", prompt, max_tokens=1, logprobs=self.k)
            if not self._with_logprobs(f"position/{n}", c):
                continue
            top = c.top_logprobs[0] or {}
            self.position_steps[n] = c
            st = expected_stats(top, expect)
            rows.append({"n": n, "prompt_tokens": c.usage.get("prompt_tokens"), **st})
        if len(rows) < 2:
            self._find("position", "skip", reason="fewer than two lengths measured")
            return
        ok = [r["expected_logprob"] >= _t("position_logprob_min") and r["expected_rank"] == 1 for r in rows]
        if all(ok):
            status, symptom = "pass", None
        elif ok[0]:  # fine when short, wrong when long
            status, symptom = "fail", "position-dependent"
        else:
            status, symptom = "fail", "wrong-answers"
        self._find("position", status, symptom,
                   metrics={"by_length": rows, "worst_logprob": min(r["expected_logprob"] for r in rows)},
                   budget={"expected_logprob_min": _t("position_logprob_min")},
                   hypothesis="counting continues correctly at every length tried",
                   explanation="" if status == "pass" else
                   ("correct at the shortest length, wrong at longer ones" if ok[0] else "wrong at every length"))

    # -- prefill vs decode ---------------------------------------------------------------------

    def prefill_decode(self) -> None:
        """The greedy probe's decode steps 1 and 2 against the same text sent as a prompt (one
        prefill each). An unrelated request before each one keeps a prefix cache from handing back
        the decode-time state."""
        g = self.greedy
        if g is None or not g.tokens or len(g.tokens) < 2:
            self._find("prefill-vs-decode", "skip", reason="the greedy probe produced fewer than 2 tokens")
            return
        rows, failed = [], False
        for j in range(1, min(3, len(g.tokens))):
            if self._complete("prefill-vs-decode/evict", "Hello", max_tokens=1) is None:
                continue
            text = COUNT_PROMPT + "".join(g.tokens[:j])
            c = self._complete(f"prefill-vs-decode/{j}", text, max_tokens=1, logprobs=self.k)
            if not self._with_logprobs(f"prefill-vs-decode/{j}", c):
                continue
            m = topk_tail(*step_pair(g, j, c, 0))
            failed |= not (m["kl"] <= _t("same_distribution_kl_max") and m["top1_agree"])
            rows.append({"step": j, **m, "decode": _top(g.top_logprobs[j] or {}, 3),
                         "prefill": _top(c.top_logprobs[0] or {}, 3)})
        if not rows:
            self._find("prefill-vs-decode", "skip", reason="no prefill request succeeded")
            return
        self._find("prefill-vs-decode", "fail" if failed else "pass", "decode-only" if failed else None,
                   metrics={"worst_kl": max(r["kl"] for r in rows)}, evidence=rows,
                   budget={"kl_max": _t("same_distribution_kl_max"), "top1_agree": True},
                   hypothesis="a decoded token's distribution equals the one computed by prefilling the same text")

    # -- echo ----------------------------------------------------------------------------------

    def echo(self) -> None:
        """The prompt's own log-probs through `echo` (opt-in): the greedy text "1 2 ... 8 9 " sent
        back with echo. Its distributions at the greedy tokens' positions are prefill results for
        decode steps 0 and 1; every prompt position also goes to the reference comparison."""
        g = self.greedy
        if g is None or not g.tokens or len(g.tokens) < 2:
            self._find("echo", "skip", reason="the greedy probe produced fewer than 2 tokens")
            return
        text = COUNT_PROMPT + "".join(g.tokens[:2])
        try:
            c = self.ep.complete(text, max_tokens=1, echo=True, logprobs=self.k)
        except EndpointError as e:
            if e.kind == "http" and e.status in (400, 404, 422, 501):
                self.ep.events.pop()  # an unsupported feature, not a server error
                self._find("echo", "skip", reason=f"the server rejects echo with logprobs: {e.detail}")
            else:
                self._failed("echo", e)
            return
        n_prompt = len(c.tokens or []) - int(c.usage.get("completion_tokens") or 1)
        echoed, tops = (c.tokens or [])[:n_prompt], (c.top_logprobs or [])[:n_prompt]
        joined = "".join(echoed)
        n_bos = int(bool(echoed) and not text.startswith(echoed[0]) and joined[len(echoed[0]):] == text)
        if not c.has_logprobs or not (joined == text or n_bos):
            self._find("echo", "skip", reason="the server does not echo the prompt's tokens with log-probs",
                       evidence=[{"text": c.text[:80], "tokens": (c.tokens or [])[:8]}])
            return
        self.features["echo"] = True
        body, body_tops = echoed[n_bos:], tops[n_bos:]  # the text's tokens, without an echoed BOS
        ids = self.server_ids.get(text) or self._tokenize(text)
        tok = self._vocab()
        if tok is not None:  # the echoed tokens against the GGUF tokenizer's pieces
            ours = tok.encode(text)
            pieces = [tok.piece(t, special=True).decode("utf-8", "replace") for t in ours]
            lead = len(ours) - len(body)
            same = lead in (0, 1) and pieces[lead:] == body
            self._find("echo/tokens", "pass" if same else "fail", None if same else "tokenizer-mismatch",
                       metrics={"echoed": len(body), "ours": len(ours)},
                       evidence=[] if same else [{"echoed": body[:12], "ours": pieces[:12]}],
                       hypothesis="the echoed prompt tokens are the GGUF tokenizer's pieces")
            if ids is None and same:
                ids = ours
        if ids is not None and len(ids) - len(body) in (0, 1):
            lead = len(ids) - len(body)  # ids before the text's first token (BOS)
            self.echo_steps = [(f"echo/{i}", ids[:lead + i], c, n_bos + i)
                               for i, top in enumerate(body_tops) if top and lead + i > 0]
        rows, failed = [], False
        for j in (0, 1):  # greedy token j sits at echoed position n_prompt - 2 + j
            top = tops[len(echoed) - 2 + j] or {}
            m = topk_tail(*step_pair(g, j, c, len(echoed) - 2 + j))
            failed |= not (m["kl"] <= _t("same_distribution_kl_max") and m["top1_agree"])
            rows.append({"step": j, **m, "decode": _top(g.top_logprobs[j] or {}, 3), "echo": _top(top, 3)})
        self._find("echo", "fail" if failed else "pass", "decode-only" if failed else None,
                   metrics={"worst_kl": max(r["kl"] for r in rows), "prompt_positions": len(self.echo_steps),
                            "elapsed_s": c.elapsed}, evidence=rows,
                   budget={"kl_max": _t("same_distribution_kl_max"), "top1_agree": True},
                   hypothesis="the prompt's own log-probs (prefill, echo) equal the greedy decode steps'")

    # -- front end -----------------------------------------------------------------------------

    def _vocab(self) -> Any:
        """The GGUF's tokenizer (reference/tokenizer.py), or None without --gguf."""
        return _reference_for(self.gguf).tok if self.gguf is not None else None

    def _named_top(self, d: dict[Any, float]) -> list[list[Any]]:
        """The 3 most likely entries of a step; an id is shown with its text."""
        return [[k, self.ep.piece(k), v] if isinstance(k, int) else [k, v] for k, v in _top(d, 3)]

    def _piece(self, token_id: int) -> str | None:
        """The text of a token id in the GGUF's vocabulary (special tokens as their text, as servers
        key them); None outside it."""
        tok = self._vocab()
        return tok.piece(token_id, special=True).decode("utf-8", "replace") if 0 <= token_id < tok.n_vocab else None

    def front_end(self) -> None:
        self.tokenization()
        self.front_end_check()
        self.stop_sequence()
        self.chat()

    def tokenization(self) -> None:
        """The server's token ids (its tokenize route) against the GGUF's tokenizer with the file's
        add_bos, and the tokenize route against what the completion path counted (usage)."""
        tok = self._vocab()
        try:
            first = self.ep.tokenize(COUNT_PROMPT)
        except EndpointError as e:
            first = None
            self._find("tokenization", "skip", reason=f"tokenize request failed: {e.kind}: {e.detail}")
        self.features["tokenize_route"] = first[1] if first else None
        texts = [COUNT_PROMPT] + [p.prompt for p in knowledge_probes(self.seed)[1:]]
        if first:
            self.server_ids[COUNT_PROMPT] = first[0]
            for t in texts[1:]:
                got = self._tokenize(t)
                if got:
                    self.server_ids[t] = got
        counted = (self.greedy.usage or {}).get("prompt_tokens") if self.greedy else None
        bos_text = tok.token_text(tok.bos_id) if tok is not None and tok.bos_id is not None else None
        bos_twice = self._complete("bos/literal", bos_text + "1 2 3 4", max_tokens=1) if bos_text else None
        if tok is None:
            if first and counted is not None:
                ok = counted == len(first[0])
                self._find("tokenization", "pass" if ok else "fail", None if ok else "tokenizer-mismatch",
                           metrics={"tokenize_route": len(first[0]), "completion_usage": counted},
                           hypothesis="the tokenize route and the completion path count the same tokens")
            self._find("bos", "skip", reason="needs --gguf (the file's add_bos and BOS id)")
            return
        rows, mism = [], []
        for t in texts:
            ours = tok.encode(t)
            theirs = self.server_ids.get(t)
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
        theirs = self.server_ids.get(COUNT_PROMPT)
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
            self._find("bos", "skip", reason="the server exposes neither a tokenize route nor usage counts")
        else:
            ok = n_bos == want_bos
            self._find("bos", "pass" if ok else "fail", None if ok else "bos",
                       metrics={"leading_bos": n_bos, "expected": want_bos}, evidence=[evidence],
                       hypothesis="the server adds BOS exactly as the GGUF's tokenizer.ggml.add_bos_token says",
                       explanation="" if ok else ("BOS doubled" if n_bos > want_bos else "BOS missing"))
        if not rows:
            self._find("tokenization", "skip", reason="the server exposes no tokenize route we know")
            return
        ok = not mism and (counted is None or counted == len(self.server_ids[COUNT_PROMPT]))
        self._find("tokenization", "pass" if ok else "fail", None if ok else "tokenizer-mismatch",
                   metrics={"texts": len(rows), "mismatched": len(mism), "completion_usage": counted},
                   evidence=mism or rows,
                   hypothesis="the server's token ids equal the GGUF tokenizer's for every probe text")

    def front_end_check(self) -> None:
        """diagnose's front-end check (checks/frontend/engine.py) with the endpoint as the engine: its
        tokenize route (which one, and the add-special asked for, in the finding) on the same prompts, held to
        the GGUF's tokenizer."""
        from ...subjects.engines.base import Deployment
        from ...subjects.engines.endpoint import EndpointEngine
        from ..frontend import engine as fe

        if self.gguf is None:
            self._find("front-end", "skip", reason="needs --gguf (the reference's tokenizer)")
            return
        engine = EndpointEngine(Deployment(url=self.ep.url))
        engine._client = self.ep  # the probe's own client: one connection, one event log
        ref = fe.ReferenceFrontEnd(self.gguf, tokenizer=self._vocab())
        try:
            rows = fe.compare(engine, ref, COUNT_PROMPT)
        except EndpointError as e:
            self._find("front-end", "skip", reason=f"tokenize request failed: {e.kind}: {e.detail}")
            return
        f = fe.finding(engine, ref, rows)
        self._find("front-end", f.status, "tokenizer-mismatch" if f.status == "fail" else None,
                   metrics=f.metrics, evidence=f.evidence, hypothesis=f.hypothesis, explanation=f.explanation,
                   **({"reason": f.reason} if f.status == "skip" else {}))

    def stop_sequence(self) -> None:
        """A counting prompt with stop=["7"]: the text must end before it, finish_reason "stop"."""
        c = self._complete("stop", "1 2 3 4", max_tokens=12, stop=["7"])
        if c is None:
            return
        if "7" in c.text:
            self._find("stop", "fail", "eos-stop", evidence=[{"text": c.text, "finish_reason": c.finish_reason}],
                       explanation="the output contains the stop sequence")
        elif c.finish_reason != "stop":
            self._find("stop", "skip", reason=f"the model never produced the stop sequence: {c.text!r}")
        else:
            self._find("stop", "pass", evidence=[{"text": c.text, "finish_reason": c.finish_reason}],
                       hypothesis="generation stops before a stop sequence and says finish_reason=stop")

    def _chat(self, msgs: list[dict[str, str]]) -> Completion | None:
        """The chat turn with top log-probs; without them where the server rejects them (HTTP 400/422). A 400
        for a model without a chat template (the server says so, or the GGUF carries none) is the server
        refusing a chat it cannot format, not a server error: "no chat template: chat refused"."""
        try:
            return self.ep.chat(msgs, max_tokens=CHAT_MAX_TOKENS, logprobs=self.k)
        except EndpointError as e:
            if not (e.kind == "http" and e.status in (400, 422)):
                return self._failed("chat", e)
            self.ep.events.pop()  # feature detection, not a server error
        try:
            out = self.ep.chat(msgs, max_tokens=CHAT_MAX_TOKENS)
        except EndpointError as e:
            if e.kind == "http" and e.status == 400 and ("chat template" in e.detail.lower() or (
                    self.gguf is not None and _gguf_chat_template(self.gguf) is None)):
                self.ep.events.pop()
                self._find("chat", "skip", reason=f"no chat template: chat refused ({e.detail})")
                return None
            return self._failed("chat", e)
        self._fails_in_row = 0
        return out

    def chat(self) -> None:
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
        c = self._chat(msgs)
        if c is None:
            return
        tok = self._vocab()
        markers = set(END_MARKERS)
        if tok is not None and tok.eos_id is not None:
            markers.add(tok.token_text(tok.eos_id))
        leaked = sorted(m for m in markers if m in c.text)
        skipped = _skipped_end_token(c, markers)
        ev = [{"text": c.text, "finish_reason": c.finish_reason, "usage": c.usage,
               "logprobs": c.has_logprobs, **(skipped or {})}]
        if leaked:
            self._find("eos", "fail", "eos-stop", evidence=ev, explanation=f"end markers in the output: {leaked}")
        elif c.finish_reason == "stop":
            self._find("eos", "pass", evidence=ev, hypothesis="a chat turn ends at the model's end token, "
                       "which is not rendered into the text")
        elif skipped:
            self._find("eos", "fail", "eos-stop", evidence=ev, metrics={"step": skipped["step"]},
                       explanation=f"the server ignores EOS: at step {skipped['step']} its own top-1 was the end "
                                   f"token {skipped['top1']!r} (log-prob {skipped['top1_logprob']:.2f}), yet it "
                                   f"generated {skipped['generated']!r} and ran on to finish_reason="
                                   f"{c.finish_reason}")
        else:
            self._find("eos", "skip", evidence=ev, reason=(
                f"the model did not end its turn within {CHAT_MAX_TOKENS} tokens (finish_reason={c.finish_reason}) "
                + ("and no step passed over an end token in the server's log-probs" if c.has_logprobs
                   else "and the server gives no chat log-probs to tell a talkative model from ignored EOS")))
        template = _gguf_chat_template(self.gguf) if self.gguf is not None else None
        if self.gguf is None or tok is None:
            self._find("chat-template", "skip", reason="needs --gguf (the file's tokenizer.chat_template)")
        elif template is None:
            self._find("chat-template", "skip", reason="the GGUF carries no tokenizer.chat_template: "
                       "the server's chat format cannot be checked against the model's")
        elif not c.usage.get("prompt_tokens"):
            self._find("chat-template", "skip", reason="the chat response has no usage.prompt_tokens")
        else:
            rendered = render_chat_template(template, msgs, bos=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                                            eos=tok.token_text(tok.eos_id) if tok.eos_id is not None else "")
            bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
            ours = tok.encode(rendered, add_bos=tok.add_bos and not (bos_text and rendered.startswith(bos_text)),
                              parse_special=True)
            ok = len(ours) == c.usage["prompt_tokens"]
            self._find("chat-template", "pass" if ok else "fail", None if ok else "chat-template",
                       metrics={"ours": len(ours), "server": c.usage["prompt_tokens"]},
                       evidence=[{"rendered": rendered}],
                       hypothesis="the chat endpoint's prompt is the GGUF template's rendering (same token count)")

    # -- reference -------------------------------------------------------------------------

    def reference(self) -> None:
        """The probes' positions through the reference forward pass on the GGUF, on the server's
        token ids (the GGUF tokenizer's where the server has no tokenize route)."""
        if self.gguf is None:
            self._find("reference", "skip", reason="no --gguf given")
            return
        tok = self._vocab()
        # (name, text, the answer, its step whose top-k is the server's at the end of text)
        items = [(f"knowledge/{p.name}", p.prompt, self.knowledge_steps.get(p.name), 0)
                 for p in knowledge_probes(self.seed)]
        items += [(f"position/{n}", counting_run(n)[0], c, 0) for n, c in self.position_steps.items()]
        g = self.greedy
        if g is not None and g.tokens:
            items += [(f"decode/{j}", COUNT_PROMPT + "".join(g.tokens[:j]), g, j) for j in range(1, len(g.tokens))]
        items = [it for it in items if it[2] is not None and it[2].step(it[3])]
        seqs: list[tuple[str, list[int], Completion, int]] = []
        for name, text, c, j in items:
            ids = self.server_ids.get(text)
            if name.startswith("decode/") and g.token_ids is not None and self.server_ids.get(COUNT_PROMPT):
                ids = self.server_ids[COUNT_PROMPT] + g.token_ids[:j]  # the very ids the server decoded
            if ids is None and self.features.get("tokenize_route"):
                ids = self._tokenize(text)
            if ids is None and tok is not None:
                ids = tok.encode(text)
            if ids:
                seqs.append((name, ids, c, j))
        seqs += self.echo_steps
        if not seqs or tok is None:
            self._find("reference", "skip", reason="no token ids for the probe texts")
            return
        self.progress(f"  reference forward pass on {self.gguf} ({len(seqs)} positions)")
        ref = _reference_for(self.gguf)
        last = ref.last_logprobs([ids for _, ids, _, _ in seqs])
        rows, colliding = [], set()
        by_ids = all(c.top_ids is not None for _, _, c, _ in seqs)
        for name, ids, c, j in seqs:
            if by_ids:
                top = c.step(j)
                want, collisions = _id_lookup(last[tuple(ids)], top), []
            else:
                top = (c.top_logprobs or [])[j] or {}
                want, collisions = ref.groups.lookup(last[tuple(ids)], top)
            colliding.update(collisions)
            m = topk_tail(top, want, want_complete=True)
            rows.append({"probe": name, "position": len(ids) - 1, "kl": m["kl"], "top1_agree": m["top1_agree"],
                         "tail_server": m["tail_got"], "tail_reference": m["tail_want"],
                         "string_collisions": collisions, "server_top": self._named_top(top),
                         "reference_top": self._named_top(want)})
        rows.sort(key=lambda r: r["position"])
        keys = "token ids" if by_ids else "text"
        note = {"top_logprobs_keys": keys, "note": "compared by token id" if by_ids else
                f"top_logprobs keyed by text: {len(colliding)} colliding pieces (each stands for more than "
                "one token id: their reference probabilities are summed, the server lists one of them)"}
        bad = [r for r in rows if r["kl"] > _t("reference_kl_max") or not r["top1_agree"]]
        rho = spearman([r["position"] for r in rows], [r["kl"] for r in rows])
        position_dependent = bool(bad) and rows[0] not in bad and rho >= _t("position_trend_min")
        status = "fail" if bad else "pass"
        symptom = ("position-dependent" if position_dependent else "reference-mismatch") if bad else None
        self._find("reference", status, symptom,
                   metrics={"kl_max": max(r["kl"] for r in rows), "kl_mean": sum(r["kl"] for r in rows) / len(rows),
                            "top1_agreement": sum(r["top1_agree"] for r in rows) / len(rows), "positions": len(rows),
                            "kl_position_spearman": rho, "top_logprobs_keys": keys,
                            "colliding_pieces": len(colliding)},
                   budget={"kl_max": _t("reference_kl_max"), "top1_agree": True}, evidence=[note, *rows],
                   hypothesis="the server's next-token distributions equal the reference forward pass on the same ids",
                   explanation="" if not bad else (
                       "agrees at short positions, diverges at long ones" if position_dependent
                       else f"{len(bad)} of {len(rows)} positions differ"))

    # -- transport and verdict --------------------------------------------------------------

    def _transport(self) -> None:
        kinds: dict[str, int] = {}
        for e in self.ep.events:
            kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        sym = {"timeout": "timeout", "malformed": "malformed-json", "http": "server-errors",
               "connect": "server-errors"}
        for kind, n in sorted(kinds.items()):
            self._find(f"transport/{kind}", "fail", sym[kind],
                       metrics={"failed_attempts": n, "requests": self.ep.n_requests},
                       explanation=f"{n} of {self.ep.n_requests} attempts failed with {kind}",
                       evidence=[e for e in self.ep.events if e["kind"] == kind][:5])
        if not kinds:
            self._find("transport", "pass", metrics={"requests": self.ep.n_requests},
                       hypothesis="every request got a well-formed answer in time, without retries")

    def _verdict(self, aborted: str | None) -> tuple[str, dict[str, list[str]]]:
        symptoms: dict[str, list[str]] = {}
        for f in self.findings:
            s = f.metrics.get("symptom")
            if f.status == "fail" and s:
                symptoms.setdefault(s, []).append(f.id)
        know = [f for f in self.findings if f.target.startswith("knowledge/") and f.status != "skip"]
        wrong = [f for f in know if f.status == "fail"]
        ref_top1 = [f.metrics.get("top1_agreement") for f in self.findings if f.target == "reference"]
        if aborted or len(know) < 3 or "missing-logprobs" in symptoms:
            return "inconclusive", symptoms
        # a deployment that tokenizes every text differently from the model is garbage to its users
        mistokenizes = any(f.target == "front-end" and f.status == "fail"
                           and f.metrics["differ"] == f.metrics["compared"] for f in self.findings)
        if len(wrong) / len(know) > _t("garbage_fraction") or "flat-distribution" in symptoms or mistokenizes or \
                (ref_top1 and ref_top1[0] is not None and ref_top1[0] < 0.5):
            return "garbage", symptoms
        if any(f.status == "fail" for f in self.findings):
            return "degraded", symptoms
        return "healthy", symptoms


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


def _top(d: dict[Any, float], n: int) -> list[list[Any]]:
    return [[k, round(v, 4)] for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:n]]


def _id_lookup(lp: Any, keys: dict[int, float]) -> dict[int, float]:
    """{id: reference log-prob} for the server's listed ids (-inf outside the reference's vocabulary)
    and the reference's most likely id. lp: [V] log-probs."""
    out = {k: float(lp[k]) if 0 <= k < len(lp) else -math.inf for k in keys}
    best = int(lp.argmax())
    out[best] = float(lp[best])
    return out


def _leading(ids: list[int], bos: int | None):
    for t in ids:
        if t != bos:
            return
        yield t


def _gguf_chat_template(path: Path) -> str | None:
    from ...gguf import open_gguf

    with open_gguf(path) as g:
        t = g.get("tokenizer.chat_template")
    return t if isinstance(t, str) and t else None


class _StringGroups:
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


class _Reference:
    """The reference forward pass on one GGUF (reference/forward.py), its tokenizer, and the
    last-position log-probs of every id sequence already run: a probe run asks for prefixes of one
    counting run, and a second run on the same file (tests, a re-probe) asks for the same texts."""

    def __init__(self, path: Path):
        from ...reference.tokenizer import Tokenizer

        self.path = path
        self.tok = Tokenizer.from_gguf(path)
        self.rows: dict[tuple[int, ...], Any] = {}  # ids -> log-probs [V] float64 at the last position
        self._groups: _StringGroups | None = None

    @property
    def groups(self) -> "_StringGroups":
        if self._groups is None:
            self._groups = _StringGroups(self.tok)
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
def _reference_at(path: str, size: int, mtime_ns: int) -> _Reference:
    return _Reference(Path(path))


def _reference_for(path: Path) -> _Reference:
    st = Path(path).stat()
    return _reference_at(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def probe(url: str, *, model: str | None = None, gguf: Path | None = None, api_key_env: str | None = None,
          concurrency: int = 4, timeout: float = 60.0, retries: int = 2, seed: int = 0,
          progress: Callable[[str], None] | None = None, steps: Iterable[str] | None = None) -> ProbeReport:
    """Probe the endpoint at `url` (see the module docstring); `steps`: a subset of STEPS."""
    with Endpoint(url, model=model, api_key_env=api_key_env, timeout=timeout, retries=retries) as ep:
        return Prober(ep, gguf=gguf, concurrency=concurrency, seed=seed, progress=progress, steps=steps).run()
