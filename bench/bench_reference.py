"""Reference forward pass on the demo model: ours vs transformers' GGUF path vs llama.cpp.

    python bench/bench_reference.py [--skip-hf] [--tokens 64] [--throughput-tokens 512]

1. Cold start to next-token logits: tokenizer + encode + load + the last position's logits of a 64-token
   prompt (what `llmdoctor logits` computes by default), each side in a fresh process timed from its
   first import. Ours: reference.load + Tokenizer.from_gguf on the same open file (as the CLI does) +
   encode + forward(all_logits=False).
   Transformers: AutoTokenizer + encode, AutoModelForCausalLM.from_pretrained(gguf_file=...) (it
   dequantizes the whole file to float32 on load) + forward(logits_to_keep=1), on our token ids (its own
   are checked to be equal). Ours runs before and after transformers (load drift on a shared machine);
   the ratio is against their mean. Prints the max |logit difference| of the two sides.
2. Prompt throughput (tokens/s) on one prompt: ours (float32, weights cached, warm) vs llama.cpp
   (llama-cpp-python, same thread count).
3. Peak RSS of a process that runs the forward with layer streaming vs with every block cached.
Each measurement runs in its own process so that RSS and cold-start times do not leak between them;
wall time and CPU time (user + system) are both reported, since other processes may share the cores.
`--threads N` sets OMP_NUM_THREADS=N in every child (both sides; llama.cpp gets N threads too).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

PROMPT = ("The history of the lighthouse is a story of people trying to make the sea a little less dangerous. "
          "Long before electric lamps, sailors relied on fires burning on hilltops to find their way home at "
          "night. The ancient Pharos of Alexandria, built on a small island near the harbour, was one of the "
          "tallest structures of its time, and travellers wrote that its light could be seen from far out at sea. ")


OURS_LOGITS = "/tmp/bench_reference_ours.pt"  # ours' next-token logits, for the difference
IDS_FILE = "/tmp/bench_reference_ids.json"  # ours' prompt ids, which transformers' forward runs on


def _prompt_ids(tok, n: int) -> list[int]:
    ids = tok.encode(PROMPT * (1 + n // 60))
    return ids[:n]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _cpu_s() -> float:
    """CPU seconds of this process (user + system): robust to other processes sharing the cores."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def child_ours(n: int, cache: bool) -> dict:
    t0 = time.perf_counter()
    import torch

    from llmdoctor.demo import model_path
    from llmdoctor.reference import load
    from llmdoctor.reference.tokenizer import Tokenizer

    model = load(model_path(), cache=cache)
    tok = Tokenizer.from_gguf(model.g)  # one open file for both, as `llmdoctor logits` does
    ids = _prompt_ids(tok, n)
    t1 = time.perf_counter()
    logits, _ = model.forward(ids, all_logits=False)  # [1, n_vocab]: the next-token logits
    t2 = time.perf_counter()
    torch.save(logits[-1].clone(), OURS_LOGITS)
    return {"tokens": len(ids), "ids": ids, "tokenizer_s": t1 - t0, "logits_s": t2 - t1,
            "total_s": t2 - t0, "cpu_s": _cpu_s(), "peak_rss_mb": _rss_mb()}


def child_hf(n: int) -> dict:
    """The same steps as child_ours, timed the same way; the forward runs on ours' ids (IDS_FILE)."""
    t0 = time.perf_counter()
    import torch
    import transformers

    from llmdoctor.demo import model_path

    path = model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    hf_ids = _prompt_ids(tok, n)
    t1 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    t2 = time.perf_counter()
    with open(IDS_FILE) as f:
        ids = json.load(f)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), logits_to_keep=1).logits[0]  # [1, n_vocab]
    t3 = time.perf_counter()
    ours = torch.load(OURS_LOGITS)
    return {"tokens": len(ids), "same_ids": hf_ids == ids, "tokenizer_s": t1 - t0, "load_s": t2 - t1,
            "logits_s": t3 - t2, "total_s": t3 - t0, "cpu_s": _cpu_s(),
            "max_abs_diff_last_logits": float((logits[-1] - ours).abs().max()), "hf_tokenizer_len": len(tok)}


def child_throughput(n: int, threads: int) -> dict:
    import torch
    import llama_cpp

    from llmdoctor.demo import model_path
    from llmdoctor.gguf import open_gguf
    from llmdoctor.reference import load
    from llmdoctor.reference.tokenizer import Tokenizer

    torch.set_num_threads(threads)
    path = model_path()
    with open_gguf(path) as g:
        ids = _prompt_ids(Tokenizer.from_gguf(g), n)
    model = load(path, cache=True)
    model.forward(ids[:8])  # dequantize and cache every block once
    t = time.perf_counter()
    model.forward(ids, all_logits=False)
    ours_s = time.perf_counter() - t
    llm = llama_cpp.Llama(str(path), n_ctx=max(1024, n + 16), n_batch=n, n_ubatch=n, verbose=False,
                          n_threads=threads, n_threads_batch=threads)
    llm.eval(ids[:8])
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    llama_s = time.perf_counter() - t
    return {"tokens": len(ids), "threads": threads, "torch_threads": torch.get_num_threads(),
            "ours_tok_s": len(ids) / ours_s, "llama_cpp_tok_s": len(ids) / llama_s}


_THREADS_ENV: dict[str, str] = {}  # --threads N: OMP_NUM_THREADS=N in every child, ours and transformers alike


def run_child(*args: str) -> dict:
    # The dev VM's 2 cores are shared with other processes: OpenMP workers that spin while waiting
    # stall every small parallel region there. Every child (ours and transformers alike) therefore
    # waits passively; an explicit OMP_WAIT_POLICY in the environment wins.
    env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ, **_THREADS_ENV}
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"child {args} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--throughput-tokens", type=int, default=512)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, help="torch/OpenMP threads of every child (default: torch's)")
    ap.add_argument("--child", nargs="+")
    a = ap.parse_args()
    if a.child:
        kind, rest = a.child[0], a.child[1:]
        res = {"ours": lambda: child_ours(int(rest[0]), rest[1] == "cache"),
               "hf": lambda: child_hf(int(rest[0])),
               "throughput": lambda: child_throughput(int(rest[0]), int(rest[1]))}[kind]()
        print(json.dumps(res))
        return
    if a.threads:
        _THREADS_ENV["OMP_NUM_THREADS"] = str(a.threads)
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores, "
          f"threads {a.threads or 'default'}, load average {os.getloadavg()[0]:.1f} at start")
    ours = run_child("ours", str(a.tokens), "stream")
    with open(IDS_FILE, "w") as f:
        json.dump(ours["ids"], f)
    print(f"ours   cold (imports included): imports + open + tokenizer {ours['tokenizer_s']:.2f} s + logits "
          f"{ours['logits_s']:.2f} s = {ours['total_s']:.2f} s ({ours['tokens']} tokens)")
    if not a.skip_hf:
        hf = run_child("hf", str(a.tokens))
        print(f"transformers cold: imports + tokenizer {hf['tokenizer_s']:.1f} s + load {hf['load_s']:.1f} s + logits "
              f"{hf['logits_s']:.2f} s = {hf['total_s']:.1f} s; same ids {hf['same_ids']}; max |next-token "
              f"logits diff| vs ours {hf['max_abs_diff_last_logits']:.2e}")
        again = run_child("ours", str(a.tokens), "stream")
        print(f"ours   again after transformers: {again['total_s']:.2f} s")
        wall = (ours["total_s"] + again["total_s"]) / 2
        cpu = (ours["cpu_s"] + again["cpu_s"]) / 2
        print(f"speedup: {hf['total_s'] / wall:.1f}x wall (goal >= 50x); CPU time ours {cpu:.2f} s, "
              f"transformers {hf['cpu_s']:.1f} s: {hf['cpu_s'] / cpu:.1f}x")
    cached = run_child("ours", str(a.tokens), "cache")
    print(f"peak RSS: streaming {ours['peak_rss_mb']:.0f} MB, all blocks cached {cached['peak_rss_mb']:.0f} MB")
    tp = run_child("throughput", str(a.throughput_tokens), str(a.threads or 2))
    print(f"prompt throughput ({tp['tokens']} tokens, {tp['threads']} threads): ours {tp['ours_tok_s']:.0f} tok/s, "
          f"llama.cpp {tp['llama_cpp_tok_s']:.0f} tok/s (ratio {tp['llama_cpp_tok_s'] / tp['ours_tok_s']:.1f}x)")
    print(f"# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
