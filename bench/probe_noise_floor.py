"""Noise floor of `llmdoctor probe`'s determinism, stream, batch and prefill-vs-decode probes on a
healthy server: how much the same greedy request differs from itself when the server's prompt cache
is cold (an unrelated request before it), warm (the same request just before it), or holds a shared
prefix only (the rest of the prompt is evaluated as a separate batch: a long or a short rest),
streamed or not; and the prompt's own log-probs (echo, one prefill batch) against decode steps.

    python -m llama_cpp.server --model <demo gguf> --host 127.0.0.1 --port 8000 --n_threads 2 &
    python bench/probe_noise_floor.py http://127.0.0.1:8000 [repeats]

Prints, against the first cold run (the anchor), the largest |delta log-prob| of the chosen tokens,
of any token both runs list (the unlikely ones are the noisy ones), and the top-k + tail KL
(metrics.topk_tail) per step.
"""

from __future__ import annotations

import sys
import time

from llmdoctor.checks.metrics import topk_tail
from llmdoctor.checks.probes import COUNT_PROMPT, THRESHOLDS
from llmdoctor.subjects.endpoint import Endpoint


def _listed_dlogprob(a: dict[str, float], b: dict[str, float]) -> float:
    return max((abs(a[t] - b[t]) for t in a if t in b), default=float("inf"))


def main() -> None:
    url = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    k = THRESHOLDS["top_k"]["value"]
    with Endpoint(url) as ep:
        ep.resolve_model()

        def greedy(stream: bool = False):
            return ep.complete(COUNT_PROMPT, max_tokens=3, logprobs=k, stream=stream)

        ep.complete("Hello", max_tokens=1)
        anchor = greedy()
        runs = []
        t0 = time.perf_counter()
        for i in range(repeats):
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


if __name__ == "__main__":
    main()
