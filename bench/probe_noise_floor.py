"""Noise floor of `llmdoctor probe`'s determinism, stream, batch and prefill-vs-decode probes on a
healthy server: how much the same greedy request differs from itself when the server's prompt cache
is cold (an unrelated request before it), warm (the same request just before it), or holds a shared
prefix only (the rest of the prompt is evaluated as a separate batch: a long or a short rest),
streamed or not; the prompt's own log-probs (echo, one prefill batch) against decode steps; and each
request of the probe's concurrent ragged batch (probes.batch_requests) against the same request alone.

    python -m llama_cpp.server --model <demo gguf> --host 127.0.0.1 --port 8000 --n_threads 2 &
    python bench/probe_noise_floor.py http://127.0.0.1:8000 [repeats] [concurrency] [--gguf FILE]

Prints, against the first cold run (the anchor), the largest |delta log-prob| of the chosen tokens,
of any token both runs list (the unlikely ones are the noisy ones), and the top-k + tail KL
(metrics.topk_tail) per step; for the batch, the same per request against its answer alone
(probes.compare_completions) and the smallest top-1 margin of the answers alone (how far the greedy
texts are from a near tie). With `--gguf FILE` (the file the server serves) it then runs the healthy
probe's knowledge, position and reference steps and prints what THRESHOLDS cite: each knowledge
probe's expected log-prob and top-10 tail mass, the units-digit log-prob per counting length, and the
server against the reference forward pass (KL, and |delta log-prob| of the server's top-1 token).
"""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor

from llmdoctor.checks.metrics import topk_tail
from llmdoctor.checks.endpoint.answers import compare_completions
from llmdoctor.checks.endpoint.probes import probe
from llmdoctor.checks.endpoint.prompts import COUNT_PROMPT, batch_requests
from llmdoctor.checks.endpoint.verdict import THRESHOLDS
from llmdoctor.subjects.endpoint import Endpoint
from llmdoctor.subjects.engines.endpoint import EndpointEngine


def _listed_dlogprob(a: dict[str, float], b: dict[str, float]) -> float:
    return max((abs(a[t] - b[t]) for t in a if t in b), default=float("inf"))


def _margin(c) -> float:
    """Smallest (top-1 - top-2) log-prob over the steps of one answer."""
    gaps = []
    for top in c.top_logprobs or []:
        v = sorted((top or {}).values(), reverse=True)
        gaps.append(v[0] - v[1] if len(v) > 1 else float("inf"))
    return min(gaps, default=float("inf"))


def batch_noise(ep: Endpoint, k: int, repeats: int, concurrency: int) -> None:
    reqs = batch_requests(concurrency)
    alone = [ep.complete(p, max_tokens=n, logprobs=k) for p, n in reqs]
    for i, (c, (p, _)) in enumerate(zip(alone, reqs)):
        print(f"batch request {i + 1}: {p[-20:]!r} -> {c.text!r}, smallest top-1 margin {_margin(c):.2f} nats")
    worst_kl = worst_d = 0.0
    differ = 0
    for _ in range(repeats):
        with ThreadPoolExecutor(len(reqs)) as pool:
            futs = []
            for p, n in reqs:
                futs.append(pool.submit(ep.complete, p, max_tokens=n, logprobs=k))
                time.sleep(0.05)
            got = [f.result() for f in futs]
        for a, b in zip(alone, got):
            m = compare_completions(a, b)
            worst_kl, worst_d = max(worst_kl, m["kl"]), max(worst_d, m["max_abs_dlogprob"])
            differ += not m["same"]
    print(f"batch of {len(reqs)} x {repeats}: batched vs alone max KL {worst_kl:.2e}, max |dlogprob| "
          f"{worst_d:.2e}, requests judged different {differ}")


def healthy_numbers(url: str, gguf: str) -> None:
    with Endpoint(url) as ep:
        rep = probe(ep, EndpointEngine.over(ep), gguf=gguf, steps=["positions", "reference"])
    for f in rep.findings:
        m = f.metrics
        if f.target.startswith("knowledge/"):
            print(f"{f.target:22s} expected log-prob {m['expected_logprob']:.3f}  rank {m['expected_rank']}  "
                  f"top-10 tail mass {m['tail_mass']:.3f}")
        elif f.target == "position":
            print("position units digit: " + ", ".join(f"{r['n']} numbers {r['expected_logprob']:.2e}"
                                                       for r in m["by_length"]))
        elif f.target == "reference":
            d = [abs(r["server_top"][0][1] - dict(r["reference_top"])[r["server_top"][0][0]])
                 for r in f.evidence if r["server_top"][0][0] in dict(r["reference_top"])]
            print(f"reference vs server, {m['positions']} positions: KL max {m['kl_max']:.2e}, mean {m['kl_mean']:.2e}, "
                  f"top-1 agreement {m['top1_agreement']:.2f}, server top-1 token |dlogprob| max {max(d):.3f}")
    print(f"healthy probe: {rep.verdict}, {rep.n_requests} requests, {rep.wall_s:.0f} s")


def main() -> None:
    gguf = None
    if "--gguf" in sys.argv:
        i = sys.argv.index("--gguf")
        gguf = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    url = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    concurrency = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    k = THRESHOLDS["top_k"]["value"]
    with Endpoint(url) as ep:
        ep.resolve_model()

        def greedy(stream: bool = False):
            return ep.complete(COUNT_PROMPT, max_tokens=3, logprobs=k, stream=stream)

        ep.complete("Hello", max_tokens=1)
        anchor = greedy()
        runs = []
        t0 = time.perf_counter()
        for _ in range(repeats):
            ep.complete("Hello", max_tokens=1)  # cold: the cache holds something else
            runs.append(("cold", greedy()))
            runs.append(("warm", greedy()))  # warm: the same prompt is cached
            runs.append(("warm-stream", greedy(stream=True)))
            ep.complete(COUNT_PROMPT[:8] + "zebra", max_tokens=1)  # shares "1 2 3 4 " only
            runs.append(("prefix", greedy()))
            ep.complete("1 2", max_tokens=1)  # shares "1 2" only: the rest is one 13-token batch
            runs.append(("short-prefix", greedy()))
        worst_d, worst_kl = 0.0, 0.0
        for label, r in runs:
            d = max(abs(x - y) for x, y in zip(anchor.token_logprobs, r.token_logprobs))
            d_all = max(_listed_dlogprob(a, b) for a, b in zip(anchor.top_logprobs, r.top_logprobs))
            kl = max(topk_tail(b, a)["kl"] for a, b in zip(anchor.top_logprobs, r.top_logprobs))
            worst_d, worst_kl = max(worst_d, d), max(worst_kl, kl)
            print(f"{label:12s} same text {r.text == anchor.text}  chosen |dlogprob| {d:.2e}  "
                  f"listed |dlogprob| {d_all:.2e}  max KL {kl:.2e}")
        echo = ep.complete(COUNT_PROMPT + "".join(anchor.tokens[:2]), max_tokens=1, echo=True, logprobs=k)
        n = len(echo.tokens) - 1  # prompt tokens echoed (BOS not echoed by llama-cpp-python)
        for j in (0, 1):  # greedy token j sits at echoed position n - 2 + j
            kl = topk_tail(anchor.top_logprobs[j], echo.top_logprobs[n - 2 + j])["kl"]
            d = _listed_dlogprob(anchor.top_logprobs[j], echo.top_logprobs[n - 2 + j])
            print(f"echo step {j}   listed |dlogprob| {d:.2e}  KL {kl:.2e}")
        print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s: noise floor max |dlogprob| {worst_d:.2e}, "
              f"KL {worst_kl:.2e} (chosen tokens, repeats); thresholds {THRESHOLDS['determinism_max_abs_dlogprob']['value']} "
              f"and {THRESHOLDS['same_distribution_kl_max']['value']}")
        batch_noise(ep, k, repeats, concurrency)
    if gguf:
        healthy_numbers(url, gguf)


if __name__ == "__main__":
    main()
