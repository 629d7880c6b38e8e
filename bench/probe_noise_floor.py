"""Noise floor of `llmdoctor probe`'s determinism, stream, batch and prefill-vs-decode probes on a
healthy server: how much the same greedy request differs from itself when the server's prompt cache
is cold (an unrelated request before it), warm (the same request just before it), or holds a shared
prefix only (the rest of the prompt is evaluated as a separate batch), streamed or not.

    python -m llama_cpp.server --model <demo gguf> --host 127.0.0.1 --port 8000 --n_threads 2 &
    python bench/probe_noise_floor.py http://127.0.0.1:8000 [repeats]

Prints the max |delta log-prob| over the tokens both runs list and the top-k + tail KL
(metrics.topk_tail) of every pair against the first cold run; the anchor is the cold run itself.
"""

from __future__ import annotations

import sys
import time

from llmdoctor.checks.metrics import topk_tail
from llmdoctor.checks.probes import COUNT_PROMPT, THRESHOLDS, _max_abs_dlogprob
from llmdoctor.subjects.endpoint import Endpoint


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
        worst_d, worst_kl = 0.0, 0.0
        for label, r in runs:
            d = max(_max_abs_dlogprob(a, b) for a, b in zip(anchor.top_logprobs, r.top_logprobs))
            kl = max(topk_tail(b, a)["kl"] for a, b in zip(anchor.top_logprobs, r.top_logprobs))
            worst_d, worst_kl = max(worst_d, d), max(worst_kl, kl)
            print(f"{label:12s} same text {r.text == anchor.text}  max |dlogprob| {d:.2e}  max KL {kl:.2e}")
        print(f"{len(runs)} runs in {time.perf_counter() - t0:.0f} s: noise floor max |dlogprob| {worst_d:.2e}, "
              f"KL {worst_kl:.2e}; thresholds {THRESHOLDS['determinism_max_abs_dlogprob']['value']} "
              f"and {THRESHOLDS['same_distribution_kl_max']['value']}")


if __name__ == "__main__":
    main()
