"""Metadata plausibility without a config: what a lone GGUF's hyperparameters betray.

Hard faults (status fail): metadata no engine can run correctly. llama.cpp's load_hparams and
create_tensor reject most of them at load time (a shape mismatch, a vocab that is not the embedding's
row count); the rest make every engine compute garbage (grouped-query attention needs n_head to be a
multiple of n_head_kv). Each rule names the key or tensor it read:

- head-count: n_head_kv is 0, above n_head, or does not divide it;
- head-dims: q / k / v / output projections whose shapes are not heads x head size (dense attention);
- vocab: token_embd's rows differ from the tokenizer's token count or `{arch}.vocab_size`;
- special-ids: a tokenizer.ggml.*_token_id outside the vocab;
- context-length: `{arch}.context_length` 0 or absent;
- block-count: tensors of blocks beyond `{arch}.block_count`, or blocks without tensors.

Soft findings (status pass, metrics.advisory true): values far from every value this architecture's
published configs use (PUBLISHED, one citation per entry: rope base, local rope base, RMS eps, logit
softcaps, rope scaling type). A name is far when it is none of them; a number is far when it is more
than a factor FAR from each:
published rope bases span 1e4..1e6 in steps of 10x or more between families, so a value within a
factor 10 of one of them is a family member (or a fine-tune); one beyond is a different model or a
corrupted key.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import MODEL_TENSOR, TENSOR_NAMES, Keys

from ..base import Finding

CHECK = "metadata"
HYPOTHESIS = "the metadata is consistent with itself and with the tensors"


@dataclass(frozen=True)
class Problem:
    rule: str
    target: str  # the metadata key or tensor that is wrong
    message: str

    @property
    def where(self) -> dict[str, str]:
        return {"tensor" if self.target.endswith((".weight", ".bias")) else "key": self.target}


def _shape(g: Any, kind: MODEL_TENSOR, il: int | None = None) -> tuple[int, ...] | None:
    name = TENSOR_NAMES[kind].format(bid=il) + ".weight"
    return g.tensor(name).shape if g.has_tensor(name) else None


def _int(g: Any, key: str) -> int | None:
    v = g.get(key)
    return None if v is None else int(v)


def hard_problems(g: Any) -> list[Problem]:
    """Every hard inconsistency of an open GGUFFile's metadata (empty: consistent)."""
    arch = g.architecture
    if arch is None:
        return [Problem("architecture", "general.architecture", "general.architecture is missing")]
    key = lambda tmpl: tmpl.format(arch=arch)  # noqa: E731
    out: list[Problem] = []
    n_embd = _int(g, key(Keys.LLM.EMBEDDING_LENGTH))
    n_head = _int(g, key(Keys.Attention.HEAD_COUNT))
    kv_key = key(Keys.Attention.HEAD_COUNT_KV)
    n_head_kv = _int(g, kv_key)
    if n_head_kv is None:
        n_head_kv = n_head
    if n_head is not None and n_head_kv is not None:
        if n_head <= 0 or n_head_kv <= 0 or n_head_kv > n_head or n_head % n_head_kv:
            out.append(Problem("head-count", kv_key, f"{kv_key} = {n_head_kv} does not divide head_count = {n_head} "
                                                     "(grouped-query attention shares each kv head among "
                                                     "n_head / n_head_kv query heads)"))
    out += _head_dims(g, arch, n_embd, n_head, n_head_kv)
    out += _vocab(g, arch)
    ctx_key = key(Keys.LLM.CONTEXT_LENGTH)
    ctx = _int(g, ctx_key)
    if not ctx or ctx < 0:
        out.append(Problem("context-length", ctx_key, f"{ctx_key} is {'absent' if ctx is None else ctx}: "
                                                      "no position can be served"))
    out += _blocks(g, arch)
    return out


def _head_dims(g: Any, arch: str, n_embd: int | None, n_head: int | None, n_head_kv: int | None) -> list[Problem]:
    """Dense attention only (an MLA model's q / kv projections have other shapes; the mapping check
    knows them)."""
    if not (n_embd and n_head and n_head_kv) or not g.has_tensor("blk.0.attn_k.weight"):
        return []
    dk = _int(g, Keys.Attention.KEY_LENGTH.format(arch=arch)) or n_embd // n_head
    dv = _int(g, Keys.Attention.VALUE_LENGTH.format(arch=arch)) or dk
    want = {MODEL_TENSOR.ATTN_Q: (n_head * dk, n_embd, f"{n_head} heads x {dk}"),
            MODEL_TENSOR.ATTN_K: (n_head_kv * dk, n_embd, f"{n_head_kv} kv heads x {dk}"),
            MODEL_TENSOR.ATTN_V: (n_head_kv * dv, n_embd, f"{n_head_kv} kv heads x {dv}"),
            MODEL_TENSOR.ATTN_OUT: (n_embd, n_head * dv, f"n_embd {n_embd} x {n_head} heads x {dv}")}
    out = []
    n_layer = _int(g, Keys.LLM.BLOCK_COUNT.format(arch=arch)) or 0
    for kind, (rows, cols, words) in want.items():
        bad = [il for il in range(n_layer) if (s := _shape(g, kind, il)) is not None and s != (rows, cols)]
        if bad:
            name = TENSOR_NAMES[kind].format(bid=bad[0]) + ".weight"
            out.append(Problem("head-dims", name, f"{name} is {list(_shape(g, kind, bad[0]))} (rows, cols), the "
                                                  f"metadata says [{rows}, {cols}] ({words}); {len(bad)} layer(s)"))
    return out


def _vocab(g: Any, arch: str) -> list[Problem]:
    emb = _shape(g, MODEL_TENSOR.TOKEN_EMBD)
    out = []
    tokens = g.fields.get(Keys.Tokenizer.LIST)
    n_tok = tokens.count if tokens is not None else None
    rows = emb[0] if emb else None
    vs_key = Keys.LLM.VOCAB_SIZE.format(arch=arch)
    for what, n in ((f"{Keys.Tokenizer.LIST} ({n_tok} tokens)", n_tok), (f"{vs_key} = {_int(g, vs_key)}", _int(g, vs_key))):
        if rows is not None and n is not None and n != rows:
            out.append(Problem("vocab", "token_embd.weight", f"token_embd.weight has {rows} rows, {what}"))
    n = n_tok if n_tok is not None else rows
    if n is not None:
        for k in sorted(g.fields):
            if k.startswith("tokenizer.ggml.") and k.endswith("_token_id"):
                v = g.get(k)
                if isinstance(v, (int, float)) and not 0 <= int(v) < n:
                    out.append(Problem("special-ids", k, f"{k} = {int(v)} is outside the vocab (0..{n - 1})"))
    return out


_BLK = re.compile(r"^blk\.(\d+)\.")


def _blocks(g: Any, arch: str) -> list[Problem]:
    k = Keys.LLM.BLOCK_COUNT.format(arch=arch)
    n = _int(g, k)
    if n is None:
        return [Problem("block-count", k, f"{k} is absent")]
    seen = {int(m.group(1)) for t in g.tensors if (m := _BLK.match(t.name))}
    beyond, missing = sorted(i for i in seen if i >= n), sorted(set(range(n)) - seen)
    out = []
    if beyond:
        out.append(Problem("block-count", k, f"{k} = {n} but tensors of block {beyond[0]} exist"))
    if missing:
        out.append(Problem("block-count", k, f"{k} = {n} but block {missing[0]} has no tensors "
                                             f"({len(missing)} block(s) missing)"))
    return out


# ---- soft findings ------------------------------------------------------------------------------

FAR = 10.0  # a value more than 10x from every published value (module docstring)


@dataclass(frozen=True)
class Published:
    values: tuple[float | str, ...]  # numbers (compared within a factor FAR) or names (compared exactly)
    source: str


# Per GGUF architecture and key suffix (after "<arch>."): values published configs use. "None" (absent)
# is a value too: gemma 3 has no logit softcapping. Sources: the config.json of each named checkpoint
# on the Hugging Face hub and transformers' config class defaults (5.x).
PUBLISHED: dict[str, dict[str, Published]] = {
    "llama": {
        "rope.freq_base": Published((1e4, 5e5, 1e6), "LlamaConfig default 1e4; Llama-2-7b-hf 1e4; "
                                    "Meta-Llama-3-8B 5e5; CodeLlama-7b-hf 1e6"),
        "attention.layer_norm_rms_epsilon": Published((1e-5, 1e-6), "Llama-2 / Llama-3 config.json 1e-5; "
                                                      "LlamaConfig default 1e-6"),
        "rope.scaling.type": Published(("none", "linear"), "Llama-2 / Llama-3 config.json rope_scaling null; "
                                       "Llama 3.1's llama3 scaling travels as the rope_freqs tensor"),
    },
    "qwen2": {
        "rope.freq_base": Published((1e4, 1e6), "Qwen2Config default 1e4; Qwen2-7B, Qwen2.5-0.5B 1e6"),
        "attention.layer_norm_rms_epsilon": Published((1e-6,), "Qwen2Config default; Qwen2.5 config.json 1e-6"),
    },
    "qwen3": {
        "rope.freq_base": Published((1e4, 1e6), "Qwen3Config default 1e4; Qwen3-0.6B / 8B config.json 1e6"),
        "attention.layer_norm_rms_epsilon": Published((1e-6,), "Qwen3Config default; Qwen3 config.json 1e-6"),
    },
    "gemma3": {
        "rope.freq_base": Published((1e6,), "Gemma3TextConfig default rope_theta 1e6; gemma-3-270m config.json"),
        "rope.freq_base_swa": Published((1e4,), "Gemma3TextConfig rope_local_base_freq 1e4"),
        "attention.layer_norm_rms_epsilon": Published((1e-6,), "Gemma3TextConfig default; gemma-3 config.json"),
        "attn_logit_softcapping": Published((), "Gemma3TextConfig: None (gemma 2 used 50)"),
        "final_logit_softcapping": Published((), "Gemma3TextConfig: None (gemma 2 used 30)"),
        "rope.scaling.type": Published(("none", "linear"), "gemma-3-270m / 1b: none; gemma-3-4b and larger: "
                                       "linear, factor 8 (config.json rope_scaling)"),
    },
    "deepseek2": {
        "rope.freq_base": Published((1e4,), "DeepseekV3Config default; DeepSeek-V2-Lite / DeepSeek-V3 config.json 1e4"),
        "attention.layer_norm_rms_epsilon": Published((1e-6,), "DeepSeek-V2-Lite / DeepSeek-V3 config.json 1e-6"),
        "rope.scaling.type": Published(("yarn",), "DeepSeek-V2-Lite / DeepSeek-V3 config.json rope_scaling yarn, "
                                       "factor 40"),
    },
}


def _far(v: float, values: tuple[float, ...]) -> bool:
    return v > 0 and all(abs(math.log10(v / e)) > math.log10(FAR) for e in values)


def soft_findings(g: Any, file: str | Path = "") -> list[Finding]:
    """Advisories for values far from the architecture's published ones; a skip when none are on record."""
    arch = g.architecture
    table = PUBLISHED.get(arch or "")
    if table is None:
        return [Finding(CHECK, "gguf", "published-values", "skip", hypothesis=HYPOTHESIS,
                        reason=f"no published values on record for architecture {arch!r} "
                               f"(known: {', '.join(sorted(PUBLISHED))})")]
    out = []
    for suffix, pub in table.items():
        key = f"{arch}.{suffix}"
        v = g.get(key)
        if not pub.values:  # published: absent
            if v is not None and float(v) != 0.0:
                out.append(_advice(key, v, "absent", pub, file))
            continue
        if isinstance(pub.values[0], str):
            if v is not None and str(v) not in pub.values:
                out.append(_advice(key, v, " or ".join(map(str, pub.values)), pub, file))
            continue
        if v is not None and _far(float(v), pub.values):
            out.append(_advice(key, v, " or ".join(f"{e:g}" for e in pub.values), pub, file))
    if not out:
        out.append(Finding(CHECK, "gguf", "published-values", "pass", hypothesis=HYPOTHESIS,
                           metrics={"keys": [f"{arch}.{s}" for s in table]},
                           explanation=f"the {arch} hyperparameters are near published values ({len(table)} of them: numbers "
                                       f"within a factor {FAR:g}, names among them)"))
    return out


def _advice(key: str, value: Any, expected: str, pub: Published, file: str | Path) -> Finding:
    return Finding(CHECK, "gguf", key, "pass", hypothesis=HYPOTHESIS,
                   metrics={"advisory": True, "value": value, "expected": expected, "source": pub.source},
                   evidence=[{"key": key, "file": str(file)}],
                   explanation=f"advisory: {key} = {value if isinstance(value, str) else f'{value:g}'} is far from "
                               f"what published configs use "
                               f"({expected}; {pub.source})")


def run(g: Any, file: str | Path = "") -> list[Finding]:
    """All metadata findings of an open GGUFFile: one fail per hard rule broken (its first target,
    every problem of the rule in the evidence), else one pass; then the soft findings."""
    problems = hard_problems(g)
    out: list[Finding] = []
    rules: dict[str, list[Problem]] = {}
    for p in problems:
        rules.setdefault(p.rule, []).append(p)
    for rule, ps in rules.items():
        out.append(Finding(CHECK, "gguf", ps[0].target, "fail", hypothesis=HYPOTHESIS, confidence="high",
                           metrics={"rule": rule, "problems": len(ps)},
                           evidence=[{**p.where, "problem": p.message, "file": str(file)} for p in ps[:8]],
                           explanation="; ".join(p.message for p in ps[:2])))
    if not out:
        arch = g.architecture
        out.append(Finding(CHECK, "gguf", str(file) or "metadata", "pass", hypothesis=HYPOTHESIS, confidence="high",
                           explanation=f"{arch}: head counts, head sizes, vocab, special ids, context length "
                                       "and block count are consistent with the tensors"))
    return out + soft_findings(g, file)
