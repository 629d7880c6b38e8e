"""What the probes ask: the knowledge probes (counting, the alphabet, copying, a fact, repetition), counting
runs of growing length, the concurrent ragged batch, and the end markers no reply may contain."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass


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

