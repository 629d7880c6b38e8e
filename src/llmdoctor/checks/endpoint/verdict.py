"""The probes' thresholds (each with its derivation), their symptom classes, and the verdict a probe run
earns from its findings: healthy, degraded, garbage or inconclusive."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..base import Finding

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
        "0.05 is ~6x that, below the up-to-0.3-nat jitter of the nondeterministic fault (tests/checks/endpoint/test_probe.py)"},
    "same_distribution_kl_max": {"value": 5e-3, "why": "the same distribution computed twice (top-10 + "
        "tail KL): repeated, streamed, alone vs batched, prefill vs decode. healthy: 0 with a cold or "
        "warm cache, 6.4e-4 with a short shared prefix cached, 6.7e-4 alone vs in a concurrent batch of 4, "
        "1.1e-4 to 3.2e-4 echo (one prefill batch) vs decode steps; 5e-3 is ~8x the largest (the "
        "decode-perturb and crosstalk faults exceed it: tests/checks/endpoint/test_probe.py)"},
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


def threshold(name: str) -> Any:
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


def probe_finding(subject: str, target: str, status: str, symptom: str | None = None, **kw: Any) -> Finding:
    """A probe's finding; the symptom class it shows (SYMPTOMS) in metrics["symptom"]."""
    metrics = dict(kw.pop("metrics", {}))
    if symptom:
        metrics["symptom"] = symptom
    return Finding("probe", subject, target, status, metrics=metrics, **kw)


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


def transport_findings(subject: str, events: list[dict[str, Any]], n_requests: int) -> list[Finding]:
    """One fail per kind of failed attempt in the client's event log (retries that recovered included), or
    one pass: a server that errors is never called healthy."""
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    sym = {"timeout": "timeout", "malformed": "malformed-json", "http": "server-errors",
           "connect": "server-errors"}
    out = [probe_finding(subject, f"transport/{kind}", "fail", sym[kind],
                         metrics={"failed_attempts": n, "requests": n_requests},
                         explanation=f"the server fails requests with {kind}: {n} of {n_requests} attempts",
                         evidence=[e for e in events if e["kind"] == kind][:5])
           for kind, n in sorted(kinds.items())]
    if not kinds:
        out.append(probe_finding(subject, "transport", "pass", metrics={"requests": n_requests},
                                 hypothesis="every request got a well-formed answer in time, without retries"))
    return out


def classify(findings: list[Finding], aborted: str | None) -> tuple[str, dict[str, list[str]]]:
    """(verdict, symptom class -> ids of the findings that show it)."""
    symptoms: dict[str, list[str]] = {}
    for f in findings:
        s = f.metrics.get("symptom")
        if f.status == "fail" and s:
            symptoms.setdefault(s, []).append(f.id)
    know = [f for f in findings if f.target.startswith("knowledge/") and f.status != "skip"]
    wrong = [f for f in know if f.status == "fail"]
    ref_top1 = [f.metrics.get("top1_agreement") for f in findings if f.target == "reference"]
    if aborted or len(know) < 3 or "missing-logprobs" in symptoms:
        return "inconclusive", symptoms
    # a deployment that tokenizes every text differently from the model is garbage to its users
    mistokenizes = any(f.target == "front-end" and f.status == "fail"
                       and f.metrics["differ"] == f.metrics["compared"] for f in findings)
    if len(wrong) / len(know) > threshold("garbage_fraction") or "flat-distribution" in symptoms or mistokenizes or \
            (ref_top1 and ref_top1[0] is not None and ref_top1[0] < 0.5):
        return "garbage", symptoms
    if any(f.status == "fail" for f in findings):
        return "degraded", symptoms
    return "healthy", symptoms

