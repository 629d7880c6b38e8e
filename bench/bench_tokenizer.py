"""Tokenizer benchmark: the reference tokenizer (reference/tokenizer.py) on the demo model against llama.cpp's own
(llama-cpp-python, vocab_only), in one run: building from the GGUF, and encoding a ~600-token text (the test
suite's mixed text, twice). Prints both and the ratios; a recorded run is in bench/RESULTS.md. (Was a timed test,
tests/reference/test_tokenizer.py::test_demo_speed, whose wall-clock bounds failed under load.)"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import llama_cpp

from llmdoctor.demo import model_path
from llmdoctor.reference.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "reference"))
from test_tokenizer import TEXT  # the parity tests' text: one corpus for both


def best(f, repeat: int = 5) -> tuple[float, object]:
    """The fastest of `repeat` calls of f, and its result."""
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = f()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    path = model_path()
    text = TEXT.replace("<", "") * 2
    build_ours, tok = best(lambda: Tokenizer.from_gguf(path), 3)
    build_llama, llm = best(lambda: llama_cpp.Llama(str(path), vocab_only=True, verbose=False), 3)
    enc_ours, ids = best(lambda: tok.encode(text), 20)
    enc_llama, ids_llama = best(lambda: llm.tokenize(text.encode(), add_bos=True, special=False), 20)
    assert ids == ids_llama, "the two tokenizers disagree on the benchmark text"
    print(f"text: {len(text)} characters, {len(ids)} tokens (identical ids)")
    print(f"build:  ours {build_ours * 1e3:8.1f} ms  llama.cpp {build_llama * 1e3:8.1f} ms  ratio {build_ours / build_llama:.2f}")
    print(f"encode: ours {enc_ours * 1e3:8.2f} ms  llama.cpp {enc_llama * 1e3:8.2f} ms  ratio {enc_ours / enc_llama:.2f}")
    print(f"encode: ours {len(ids) / enc_ours:,.0f} tokens/s, llama.cpp {len(ids) / enc_llama:,.0f} tokens/s")


if __name__ == "__main__":
    main()
