"""Where the time of `llmdoctor probe`'s tests goes on a llama-cpp-python server, and the one part of
it that is llmdoctor's: the reference rows of `checks/endpoint/reference_logprobs.py` (`ReferenceLogprobs.last_logprobs`).

1. The engine (the anchor): llama-cpp-python's `create_completion` with and without top-10 log-probs,
   in-process with the settings `llama_cpp.server` uses (logits_all) and the tests' (2 threads, n_ctx
   1024), 8 greedy tokens of the counting prompt; and the share of its own per-token sort of the
   whole vocabulary (`sorted(zip(logprobs, range(n_vocab)))` in llama_cpp/llama.py), by cProfile.
2. Ours: after one forward pass of the probe's longest sequence (the counting run of POSITION_N[-1]),
   the old row extraction (log_softmax of all T rows, then the rows asked for) against the new one
   (log_softmax of the rows asked for), bit-identical, timed `repeats` times each.

    python bench/bench_probe_reference.py [repeats]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import torch


def engine(path: str) -> None:
    from llama_cpp import Llama

    from llmdoctor.checks.endpoint.prompts import COUNT_PROMPT

    llm = Llama(path, n_ctx=1024, n_threads=2, n_threads_batch=2, logits_all=True, verbose=False)
    times: dict[object, list[float]] = {None: [], 10: []}
    for lp in (None, 10, None, 10):
        t = time.perf_counter()
        llm.create_completion(COUNT_PROMPT, max_tokens=8, temperature=0.0, logprobs=lp)
        times[lp].append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    llm.create_completion(COUNT_PROMPT, max_tokens=8, temperature=0.0, logprobs=10)
    prof.disable()
    st = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    total = sum(v[2] for v in st.values())
    sort_s = sum(v[2] for k, v in st.items() if k[2] == "<built-in method builtins.sorted>")
    print(f"engine: 8 tokens without log-probs min {min(times[None]):.2f} s, with top-10 min {min(times[10]):.2f} s; "
          f"profiled run {total:.2f} s of which llama-cpp-python's vocabulary sort {sort_s:.2f} s "
          f"({sort_s / 8:.2f} s a token, {100 * sort_s / total:.0f}%)")


def ours(path, repeats: int) -> None:
    from llmdoctor.checks.endpoint.prompts import POSITION_N, counting_run
    from llmdoctor.reference import load
    from llmdoctor.reference.forward import log_softmax
    from llmdoctor.reference.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    runs = [tok.encode(counting_run(n)[0]) for n in POSITION_N]  # each a prefix of the longest
    ids = runs[-1]
    assert all(ids[:len(r)] == r for r in runs)
    rows = [len(r) - 1 for r in runs]
    with load(path, cache=True) as model:
        t = time.perf_counter()
        logits, _ = model.forward(ids)  # [T, V]
        fwd = time.perf_counter() - t
    old_s, new_s = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        lp = log_softmax(logits)  # [T, V] float64
        old = [lp[i].clone() for i in rows]
        old_s.append(time.perf_counter() - t)
        del lp
        t = time.perf_counter()
        new = list(log_softmax(logits[rows]))  # [len(rows), V] float64
        new_s.append(time.perf_counter() - t)
    same = all(torch.equal(a, b) for a, b in zip(old, new))
    print(f"ours: forward pass T={len(ids)} {fwd:.2f} s (once per probe run, cached per file and ids); rows "
          f"{rows}: log_softmax of all rows then {len(rows)} min {min(old_s):.3f} s, of the {len(rows)} rows "
          f"min {min(new_s):.3f} s ({min(old_s) / min(new_s):.0f}x), bit-identical {same}")


def main() -> None:
    from llmdoctor.demo import model_path

    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(2)
    engine(str(model_path()))
    ours(model_path(), repeats)


if __name__ == "__main__":
    main()
