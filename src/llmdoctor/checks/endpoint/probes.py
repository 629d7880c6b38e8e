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

Every threshold is in `THRESHOLDS` (verdict.py) with its derivation; the report shows them. A server
that errors, times out, returns malformed JSON or omits logprobs is never called healthy.

The caller opens the endpoint (subjects/endpoint.py's client, and the same endpoint as an engine for the
front-end check) and hands both in: a check asks a subject, it does not start one. The steps live in
symptom_steps.py, front_end_steps.py and reference_comparison.py, sharing a ProbeSession (session.py);
what they ask is prompts.py's, how answers compare answers.py's, the reference's log-probs
reference_logprobs.py's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterable

from ...completion import EndpointError
from ...errors import InputError
from .front_end_steps import front_end
from .reference_comparison import reference
from .session import ProbeAborted, ProbeSession
from .symptom_steps import batch, echo, knowledge, positions, prefill_decode, repeat
from .verdict import ProbeReport, classify, transport_findings

# The probe steps in the order they run: name -> (title, step); "knowledge" always runs first.
# "echo" is opt-in: prompt log-probs cost llama-cpp-python ~1.8 s per prompt token.
STEPS: dict[str, tuple[str, Callable[[ProbeSession], None]]] = {
    "knowledge": ("knowledge probes", knowledge), "repeat": ("determinism and streaming", repeat),
    "batch": ("concurrent ragged batch", batch), "positions": ("positions", positions),
    "prefill_decode": ("prefill vs decode", prefill_decode), "echo": ("prompt log-probs (echo)", echo),
    "front_end": ("front end", front_end), "reference": ("reference", reference)}
DEFAULT_STEPS = tuple(s for s in STEPS if s != "echo")


def probe(ep: Any, front_end_engine: Any, *, gguf: Path | None = None, concurrency: int = 4, seed: int = 0,
          progress: Callable[[str], None] | None = None, steps: Iterable[str] | None = None) -> ProbeReport:
    """Probe the endpoint behind the client `ep` (see the module docstring, and ProbeSession for what `ep`
    and `front_end_engine` offer); `steps`: a subset of STEPS."""
    unknown = set(steps or ()) - set(STEPS)
    if unknown:
        raise InputError(f"unknown probe steps {sorted(unknown)}; known: {', '.join(STEPS)}")
    wanted = DEFAULT_STEPS if steps is None else set(steps)
    names = ["knowledge", *[s for s in STEPS if s != "knowledge" and s in wanted]]
    s = ProbeSession(ep, front_end_engine, gguf=gguf, concurrency=concurrency, seed=seed, progress=progress)
    t0 = time.perf_counter()
    try:
        s.progress(f"probing {ep.base}")
        ep.resolve_model()
        s.features["model"] = ep.model
        for name in names:
            title, step = STEPS[name]
            s.progress(f"  {title} ({time.perf_counter() - t0:.0f} s)")
            step(s)
        aborted = None
    except (ProbeAborted, EndpointError) as e:
        aborted = str(e)
        if isinstance(e, EndpointError):
            s.find("connect", "fail", "unreachable" if e.kind == "connect" else None,
                   explanation=f"could not start probing: {e}")
    s.findings += transport_findings(s.subject, ep.events, ep.n_requests)
    verdict, symptoms = classify(s.findings, aborted)
    wall = time.perf_counter() - t0
    s.progress(f"verdict {verdict} after {wall:.0f} s, {ep.n_requests} requests")
    return ProbeReport(ep.base, ep.model, verdict, s.findings, symptoms, s.features, wall, ep.n_requests,
                       list(ep.events))
