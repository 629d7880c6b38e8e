"""`llmdoctor check attention`: attention kernels against the float64 reference, case by case.

Cases come from a model's attention shape (a preset, an HF config or a GGUF), at lengths scaled down
to stay fast (the bugs hunted live in the batch structure): batch 1 and ragged batches, q_len 1,
q_len < k_len, a context chunk in which a sequence has kv_len 0, lengths that are not multiples of the
cache block size, a long sequence, sliding window / softcap when the model has them, paged latent
caches with unused pages full of NaN, DSA top-k rows as indexers emit them; and long-key cases (up to
4100 keys, few queries, few kv heads for prefill) crossing the tile / page / window boundaries of 64 to
4096. Every case relies only on conventions real kernels share (reference/attention_cases.py names
the source of each); an input real engines never give (a duplicated top-k entry) is a `probe` case,
reported as information, never judged. Every case draws fresh random inputs (never zeros), seeded by
`--seed` and the case's name; a subject taking `out=` gets a NaN-filled buffer.

An fp8 latent cache (`mla-decode-fp8`) gets its floor the same way, its cache rounded through
float8_e4m3fn at the per-tensor scale; the subject is judged against the float64 math on the dequantized
fp8 cache it was given.

Budget in float32 (issue 18): `rounding_bound`, per element, derived for any summation order (a
float32 kernel's error IS its accumulation order, which is the kernel's choice: a floor emulated from
one order bounds nothing about another; measured, the old 4 x floor held for the plain and tiled
kernels here, with a margin of under 3x on batch1).

Budget in bfloat16 / float16 (issue 6): the noise floor of a case in a dtype is the largest error, over 5 seeds, of the
reference math run with its inputs rounded to the dtype, the probabilities P rounded to the dtype
before P·V, and the output rounded to the dtype (lse rounded to float32, what kernels return),
measured against the float64 math on the unrounded inputs. The emulation accumulates in float32
(`reference.attention.acc_dtype`), as kernels do: measured on CPU, a float64-accumulating emulation
gives a float32 floor 4-8x below what correct float32 kernels (SDPA math, flex) reach on 300-key rows,
because the P·V sum's rounding scales with sum |p v| while the output's scales with |sum p v|. A
correct kernel makes the same kinds of roundings in a different order, so its error stays within a
small multiple of the floor; a case fails above K_FLOOR = 4 x floor in max |err| (per sequence) or in
relative L2 (per case). NaN/inf where the reference is finite fails, except where it comes from the
unused rows of a paged cache alone: a case whose output has NaN is judged again with those rows finite
(`stale_unused_rows`), and passing then, it is reported as information (the kernel weighs rows past
seq_len by zero, as flash-attn's paged MLA kernel does on the H200). The subject's error is
measured against the float64 math on the inputs it was given (already rounded), so input rounding is
counted once, in the floor: the budget errs generous.

A failure is explained twice: by pattern (which sequences of the case fail; across cases, which
dtype / head size / contract / chunked mode alone fails) and by signature (the output equals the
reference with one named mistake applied: softmax scale from the wrong dim, top-left causal
alignment, V read from the wrong part of the latent cache row, LSE in log2).
Consistency cases: prefill row t == decode at t, chunked == unchunked (context chunks merged by the
subject's own LSE), absorbed MLA == naive MLA (a subject with both prefill and mla-decode).
"""

from __future__ import annotations

import functools
import math
import time
import zlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ...errors import InputError
from ...reference import attention as attn
from ...reference import attention_cases as ref
from ...reference import mla as mla_ref
from ...subjects import attention as subj
from ...subjects.isolation import Isolated, LoadFailed, Outcome
from .. import metrics
from ..base import Finding

CHECK = "attention"
K_FLOOR = 4.0
FLOOR_SEEDS = 5
DTYPES = ("float32", "bfloat16", "float16")
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- shapes

@dataclass(frozen=True)
class Shape:
    """A model's attention shape: the dense (prefill) view, plus the MLA latent view when it has one."""

    name: str
    n_head: int
    n_head_kv: int
    head_dim: int  # Dqk of the prefill contract (MLA: qk_nope + qk_rope, the naive form)
    head_dim_v: int
    scale: float
    window: Optional[int] = None  # sliding window of the model (keys seen, own included)
    softcap: Optional[float] = None
    mla: Optional[mla_ref.MLA] = None

    @property
    def top_k(self) -> int:
        return self.mla.indexer.top_k if self.mla and self.mla.indexer else 0


def _mla_shape(name: str, m: mla_ref.MLA, n_head: int) -> Shape:
    return Shape(name, n_head, n_head, m.qk_dim, m.v_dim, mla_ref.kq_scale(m), mla=m)


# Numbers from the models' HF configs (GLM-5's as issue 6 gives them).
PRESETS: dict[str, Shape] = {
    "glm-5": _mla_shape("glm-5", mla_ref.MLA(2048, 512, 192, 64, 256, indexer=mla_ref.Indexer(32, 128, 2048, (True,))),
                        64),
    "deepseek-v3": _mla_shape("deepseek-v3", mla_ref.MLA(1536, 512, 128, 64, 128,
                                                         yarn=mla_ref.Yarn(40.0, 4096, 32.0, 1.0, 1.0)), 128),
    "gemma3-270m": Shape("gemma3-270m", 4, 1, 256, 256, 1 / math.sqrt(256), window=512),
    "llama-3-8b": Shape("llama-3-8b", 32, 8, 128, 128, 1 / math.sqrt(128)),
}


def shape_from_config(cfg: Any, name: str) -> Shape:
    """Shape of a `reference.config.ModelConfig` (from a GGUF or an HF config)."""
    if cfg.mla is not None:
        return _mla_shape(name, cfg.mla, cfg.n_head)
    return Shape(name, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.head_dim_v, cfg.attn_scale,
                 window=cfg.sliding_window, softcap=cfg.attn_softcap)


def load_shape(preset: Optional[str], config: Optional[Path], gguf_file: Optional[Path]) -> Shape:
    given = [x for x in (preset, config, gguf_file) if x is not None]
    if len(given) > 1:
        raise InputError("give one of --preset, --config, --gguf")
    from ...reference import config as cfgmod

    if config is not None:
        return shape_from_config(cfgmod.from_hf(config), str(config))
    if gguf_file is not None:
        from ...gguf import open_gguf

        with open_gguf(gguf_file) as g:
            return shape_from_config(cfgmod.from_gguf(g), str(gguf_file))
    preset = preset or "glm-5"
    if preset not in PRESETS:
        raise InputError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[preset]


# ----------------------------------------------------------------------------- cases

@dataclass(frozen=True)
class Case:
    """One call pattern. seqs: (q_len, kv_len) per sequence (MLA: kv_len = seq_len, the query
    tokens being its last q_len positions). `chunk`: run as chunked prefill (context chunks of this
    many keys, non-causal, then the causal new-token part, merged by the subject's LSE)."""

    name: str
    contract: str
    seqs: tuple[tuple[int, int], ...]
    causal: bool = True
    window: Optional[int] = None
    softcap: Optional[float] = None
    block_size: int = 16
    top_k: int = 0
    chunk: int = 0
    fp8_cache: bool = False  # the latent cache in float8_e4m3fn with a per-tensor scale (kv_scale=)
    n_head_kv: int = 0  # prefill: this many kv heads (and their query groups) instead of the model's (long cases)
    probe: str = ""  # an input real engines never give, probed on purpose: reported as information, not judged

    @property
    def total_q(self) -> int:
        return sum(t for t, _ in self.seqs)


# Scaled-down stand-ins: a long sequence of 300 keys, windows and top-k of ~1/8 of the lengths.
LONG, WINDOW, TOPK = 300, 13, 24
# Long-key cases (issue 16): kernels split keys in tiles, pages and windows of 64 to 4096, so these cross
# every power-of-two boundary up to 4096 (4100 = 4096 + 4, 1100 > 1024, 700 > 512) with few queries;
# the prefill ones keep LONG_HEADS_KV kv heads (and their query groups) so the float64 reference stays
# cheap (the latent MLA cache is one head: those keep the model's heads).
LONG_KEYS, LONG_HEADS_KV = 4100, 2


def cases(shape: Shape) -> list[Case]:
    out = [
        Case("batch1", "prefill", ((37, 37),)),
        Case("ragged", "prefill", ((5, 5), (1, 19), (7, 40), (16, 16))),
        Case("decode-batch", "prefill", ((1, 33), (1, 1), (1, 64))),
        Case("context-chunk-kv0", "prefill", ((4, 16), (3, 0), (5, 9)), causal=False),
        Case("long", "prefill", ((9, LONG),)),
        Case("long-keys", "prefill", ((3, LONG_KEYS), (2, 1100), (4, 700)), n_head_kv=LONG_HEADS_KV),
        Case("chunked", "prefill", ((4, 20), (3, 3), (6, 45)), chunk=16),
    ]
    if shape.window:
        out.append(Case("sliding-window", "prefill", ((6, 40), (17, 17)), window=min(shape.window, WINDOW)))
        w = shape.window  # the model's own window, crossed by a long sequence
        out.append(Case("long-window", "prefill", ((3, w + 600), (2, max(w // 2, 1))), window=w,
                        n_head_kv=LONG_HEADS_KV))
    if shape.softcap:
        out.append(Case("softcap", "prefill", ((6, 40), (17, 17)), softcap=shape.softcap))
    if shape.mla:
        out += [
            Case("mla-decode-b1", "mla-decode", ((1, 37),)),
            Case("mla-decode-ragged", "mla-decode", ((1, 1), (1, 17), (1, 64), (1, 100))),
            Case("mla-decode-long", "mla-decode", ((1, LONG),), block_size=64),
            Case("mla-decode-long-keys", "mla-decode", ((1, LONG_KEYS), (1, 1100)), block_size=64),
            Case("mla-decode-fp8", "mla-decode", ((1, 37), (1, 64)), fp8_cache=True),
        ]
    if shape.top_k:
        k = min(shape.top_k, TOPK)
        out += [
            Case("sparse-decode", "mla-sparse-decode", ((1, 37), (1, 9), (1, 100)), top_k=k),
            Case("sparse-prefill", "mla-sparse-prefill", ((5, 20), (1, 9), (12, 12), (7, 70)), top_k=k),
            Case("sparse-decode-long-keys", "mla-sparse-decode", ((1, LONG_KEYS), (1, 1100)), top_k=shape.top_k,
                 block_size=64),
            Case("sparse-prefill-long-keys", "mla-sparse-prefill", ((2, LONG_KEYS),), top_k=shape.top_k,
                 block_size=64),
            Case("sparse-decode-duplicates", "mla-sparse-decode", ((1, 37), (1, 9), (1, 100)), top_k=k,
                 probe="duplicates"),
        ]
    return out


def shape_for(shape: Shape, case: Case) -> Shape:
    """The shape a case runs at: the model's, or for a long prefill case LONG_HEADS_KV kv heads with the
    model's query group size."""
    if not case.n_head_kv or case.contract != "prefill" or shape.n_head_kv <= case.n_head_kv:
        return shape
    group = shape.n_head // shape.n_head_kv
    return dataclasses.replace(shape, n_head=case.n_head_kv * group, n_head_kv=case.n_head_kv)


def _dims(shape: Shape, case: Case) -> dict[str, int]:
    """Head sizes of a case (what 'only one head size fails' is judged on)."""
    if case.contract == "prefill":
        return {"dqk": shape.head_dim, "dv": shape.head_dim_v}
    return {"dqk": shape.mla.kv_lora_rank + shape.mla.qk_rope, "dv": shape.mla.kv_lora_rank}


# ----------------------------------------------------------------------------- inputs

def make_inputs(shape: Shape, case: Case, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Fresh float64 inputs (int32 index tensors) of a case, drawn on the CPU (the same numbers on every
    machine), then moved to `device`, where the reference math runs (float64 on the GPU for --device cuda:
    the full-width presets would take minutes on the CPU)."""
    return {n: v.to(device) for n, v in _draw(shape, case, seed).items()}


def case_seed(seed: int, case: Case) -> int:
    """The seed of a case's inputs: the run's seed and the case's NAME (not its position in a selection:
    `--cases long` and the full run must judge `long` on the same numbers)."""
    return seed * 1_000_003 + zlib.crc32(case.name.encode())


def _draw(shape: Shape, case: Case, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    lens_q = torch.tensor([t for t, _ in case.seqs])
    lens_k = torch.tensor([s for _, s in case.seqs])
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    x: dict[str, torch.Tensor] = {"cu_q": cu_q}
    if case.contract == "prefill":
        tk = int(lens_k.sum())
        x |= {"q": randn(case.total_q, shape.n_head, shape.head_dim),
              "k": randn(tk, shape.n_head_kv, shape.head_dim),
              "v": randn(tk, shape.n_head_kv, shape.head_dim_v),
              "cu_k": torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)}
        return x
    m = shape.mla
    width, bs = m.kv_lora_rank + m.qk_rope, case.block_size
    pages = [-(-s // bs) for _, s in case.seqs]
    n_blocks = sum(pages) + 2  # + unused pages, left NaN
    order = torch.randperm(n_blocks, generator=gen)
    cache = torch.full((n_blocks, bs, width), float("nan"), dtype=torch.float64)
    table = torch.full((len(case.seqs), max(max(pages), 1) + 1), int(order[-1]), dtype=torch.int32)  # pad: a NaN page
    at = 0
    for b, (_, s) in enumerate(case.seqs):
        blocks = order[at:at + pages[b]]
        at += pages[b]
        table[b, :pages[b]] = blocks.to(torch.int32)
        rows = randn(s, width)
        flat = cache[blocks.long()].reshape(-1, width)
        flat[:s] = rows  # the tail of the last page stays NaN
        cache[blocks.long()] = flat.reshape(-1, bs, width)
    x |= {"q": randn(case.total_q, shape.n_head, width), "kv_cache": cache, "block_table": table,
          "seq_lens": lens_k.to(torch.int32)}
    if case.top_k:
        x["topk"] = _topk(case, gen)
    return x


def _topk(case: Case, gen: torch.Generator) -> torch.Tensor:
    """int32 [total_q, K]: what a DSA indexer emits for each query at position `last` (bottom-right):
    min(K, last + 1) distinct positions in [0, last] in score order (here random), every other row
    holding `last` itself (the causal limit), then -1 padding as a suffix (vLLM's indexer: torch.topk
    over the causal range puts the masked scores last and writes -1 there). probe="duplicates": each
    row lists its first position twice (in place of a pad, or of its last pick), which no indexer does."""
    k = case.top_k
    rows = []
    for t, s in case.seqs:
        for i in range(t):
            last = s - t + i
            n = min(k, last + 1)
            pick = torch.randperm(last + 1, generator=gen)[:n]
            if i % 2 == 0 and not (pick == last).any():
                pick[torch.randint(n, (1,), generator=gen)] = last
            row = torch.cat([pick, torch.full((k - n,), -1, dtype=torch.int64)])
            if case.probe == "duplicates" and n > 1:
                row[n if n < k else n - 1] = row[0]
            rows.append(row)
    return torch.stack(rows).to(torch.int32)


FP8 = torch.float8_e4m3fn


def fp8_cache(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """x with its latent cache rounded through float8_e4m3fn at a per-tensor scale (amax / 448, the
    format's largest finite value), and that scale as `kv_scale`: what an fp8-cache engine stores."""
    cache = x["kv_cache"]
    scale = cache[torch.isfinite(cache)].abs().max() / torch.finfo(FP8).max
    return {**x, "kv_cache": (cache / scale).to(FP8).to(torch.float64) * scale, "kv_scale": scale}


def stale_unused_rows(x: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """x with every unused latent-cache row (the last page's tail, the pad and unused pages: NaN in x)
    holding finite random rows, as a page reused from an earlier request holds them (an fp8 cache's at
    its scale). The follow-up to a NaN output: a kernel that weighs those rows by zero (0 x NaN) is right
    here, one that attends to them is not."""
    cache = x["kv_cache"]
    gen = torch.Generator().manual_seed(seed)
    amax = cache[torch.isfinite(cache)].abs().max()
    fill = torch.randn(cache.shape, generator=gen, dtype=torch.float64).to(cache.device).clamp(-amax, amax)
    if "kv_scale" in x:
        fill = (fill / x["kv_scale"]).to(FP8).to(torch.float64) * x["kv_scale"]
    return {**x, "kv_cache": torch.where(torch.isnan(cache), fill, cache)}


def _rounded(x: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The inputs in `dtype` (the reference math on them accumulates in float32)."""
    return {n: (v.to(dtype) if v.is_floating_point() else v) for n, v in x.items()}


# ----------------------------------------------------------------------------- the reference

@dataclass(frozen=True)
class Variant:
    """A reference computed with one named mistake (None fields: the contract's own semantics)."""

    scale: Optional[float] = None
    top_left: bool = False
    v_from: int = 0


def reference(shape: Shape, case: Case, x: dict[str, torch.Tensor], *, p_dtype: Optional[torch.dtype] = None,
              out_dtype: Optional[torch.dtype] = None, variant: Variant = Variant(), duplicates: str = "once",
              op: Callable = attn.partial_attention) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [H, Tq]) in float64 of a case on inputs x; with out_dtype, each kernel call's output
    is rounded to it (its lse to float32), as a kernel writes them. `op` replaces the per-block math
    (`rounding_bound` gives the float32 bound of each call instead; chunked cases: `f32_budget`)."""
    scale = variant.scale or shape.scale

    def rnd(o: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if out_dtype is None:
            return o.double(), l.double()
        return o.to(out_dtype).to(torch.float64), l.to(torch.float32).to(torch.float64)

    if case.contract != "prefill":
        topk = x.get("topk")
        return rnd(*ref.mla_paged(x["q"], x["kv_cache"], x["block_table"], x["cu_q"], x["seq_lens"], scale=scale,
                                  kv_lora_rank=shape.mla.kv_lora_rank, topk=topk, top_left=variant.top_left,
                                  p_dtype=p_dtype, v_from=variant.v_from, duplicates=duplicates, op=op))
    kw = dict(scale=scale, window=case.window, softcap=case.softcap, top_left=variant.top_left, p_dtype=p_dtype,
              op=op)
    if not case.chunk:
        return rnd(*ref.varlen(x["q"], x["k"], x["v"], x["cu_q"], x["cu_k"], causal=case.causal, **kw))
    pieces = [rnd(*ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, **kw))
              for k, v, cu_k, causal in chunk_calls(case, x)]
    out, lse = ref.merge_chunks([o for o, _ in pieces], [l for _, l in pieces])
    return rnd(out, lse)


def chunk_calls(case: Case, x: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
    """The prefill calls of a chunked case: (k, v, cu_k, causal) per call — context chunks of
    `case.chunk` keys per sequence (kv_len 0 where a sequence's context is shorter), then the causal
    call over each sequence's own new tokens."""
    ctx = [s - t for t, s in case.seqs]
    n_chunks = max(-(-c // case.chunk) for c in ctx) if any(ctx) else 0
    cu = x["cu_k"].tolist()
    calls = []

    def gather(spans: list[tuple[int, int]], causal: bool) -> None:
        idx = torch.cat([torch.arange(a, b) for a, b in spans]) if spans else torch.zeros(0, dtype=torch.int64)
        lens = torch.tensor([b - a for a, b in spans])
        cu_k = torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)
        calls.append((x["k"][idx], x["v"][idx], cu_k, causal))

    for c in range(n_chunks):
        gather([(cu[b] + min(c * case.chunk, ctx[b]), cu[b] + min((c + 1) * case.chunk, ctx[b]))
                for b in range(len(ctx))], False)
    gather([(cu[b] + ctx[b], cu[b + 1]) for b in range(len(ctx))], True)
    return calls


@dataclass
class Floor:
    out_max: float
    out_rel: float
    lse_max: float


def noise_floor(shape: Shape, case: Case, dtype: torch.dtype, device: str = "cpu") -> Floor:
    """Largest error over FLOOR_SEEDS seeds of the rounded emulation (module docstring)."""
    fl = Floor(0.0, 0.0, 0.0)
    for seed in range(FLOOR_SEEDS):
        x = make_inputs(shape, case, 10_000 + seed, device)
        want, want_lse = reference(shape, case, x)
        emu, emu_lse = reference(shape, case, _rounded(fp8_cache(x) if case.fp8_cache else x, dtype), p_dtype=dtype,
                                 out_dtype=dtype)
        fl.out_max = max(fl.out_max, metrics.max_abs_diff(emu, want))
        fl.out_rel = max(fl.out_rel, metrics.rel_l2(emu, want))
        fin = torch.isfinite(want_lse)
        fl.lse_max = max(fl.lse_max, metrics.max_abs_diff(emu_lse[fin], want_lse[fin]))
    return fl


# ----------------------------------------------------------------------------- the float32 budget

def rounding_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, *, scale: float,
                   u: float, softcap: float | None = None,
                   p_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Bound on |kernel - exact| of attention computed in a float format of unit roundoff u, in ANY
    summation order (plain, blocked, split-K, online softmax), for float64 inputs that the kernel got
    exactly: (out bound [T, H, Dv], lse bound [T, H]), 0 for rows with no visible key. `p_dtype` is
    accepted for the wrappers' signature and ignored (the bound is for a kernel that keeps P in u).

    Derivation (Higham §2.2/§3.1: fl(a op b) = (a op b)(1 + δ), |δ| <= u; a sum of n terms in any order
    has error <= γ_{n-1}·Σ|terms|, γ_n = n·u / (1 - n·u)). For a query with n visible keys j:
    - score s_j = scale·q·k_j (D products, D - 1 additions, the scale and a possible log2(e) fold):
      |Δs_j| <= γ_{D+2}·scale·Σ_d |q_d k_dj|; softcap c·tanh(s/c) has slope <= 1 and adds 6u·|s_j|
      (divide, tanh within 4u, multiply);
    - the weight w_j = exp(s_j - m) of any subtracted maximum m (a common m cancels in out = Σ w v / Σ w):
      relative error a_j <= |Δs_j| + 2u·|s_j - m| (the subtraction and the log2(e) fold) + 4u (exp,
      within 4u also for ex2.approx);
    - online softmax rescales the running sums when the maximum grows, at most n - 1 times; the factors
      exp(m_old - m_new) have errors 2u·|m_old - m_new| + 4u, and the |m_old - m_new| telescope to at
      most the score range R = m - min_j s_j; each term then meets at most n - 1 additions and n - 1
      rescaling multiplies, and the final division and store: ε = γ_{6n+2} + 2u·R covers every path.
    Perturbing the weights by (1 + α_j), |α_j| <= a_j, moves out by Σ_j p_j α_j (v_j - out) / (1 - max a):
    |Δout| <= (Σ p_j a_j |v_j| + Σ p_j a_j·|out|) / (1 - max a) + ε/(1 - ε)·(Σ p_j |v_j| + |out|) + u·|out|,
    and lse = m + log Σ w: |Δlse| <= Σ p_j a_j / (1 - max a) + ε/(1 - ε) + 4u·(|lse| + |m| + 1).
    The bound is linear in the number of keys and the head size (worst case: each rounding error at
    its largest, all of one sign); it is what every correct order of the sums is guaranteed to meet.
    """
    t, h, d = q.shape
    s, hk, dv = v.shape
    x = attn.scores(q, k, scale=scale, softcap=softcap)  # [H, T, S] float64
    ds = metrics.gamma(d + 2, u) * attn.scores(q.abs(), k.abs(), scale=abs(scale))  # [H, T, S]: |Δs| before softcap
    if softcap:
        ds = ds + 6 * u * x.abs()
    none = ~allowed[None]
    xm = x.masked_fill(none, float("-inf"))
    lse = torch.logsumexp(xm, dim=-1)  # [H, T]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(xm - safe[..., None])  # [H, T, S]
    m = xm.amax(-1).masked_fill(~torch.isfinite(lse), 0.0)  # [H, T]
    lo = x.masked_fill(none, float("inf")).amin(-1).masked_fill(~torch.isfinite(lse), 0.0)
    a = (ds + 2 * u * (x - m[..., None]).abs() + 4 * u).masked_fill(none, 0.0)  # [H, T, S]
    n = allowed.sum(-1).to(x.dtype)  # [T]
    eps = (6 * n + 2) * u / (1 - (6 * n + 2) * u) + 2 * u * (m - lo)  # [H, T]: γ_{6n+2} + 2u·R
    shrink = 1 - a.amax(-1)  # [H, T]
    vg = v.to(x.dtype).abs().permute(1, 0, 2)[:, None]  # [Hk, 1, S, Dv]

    def pv(w: torch.Tensor) -> torch.Tensor:  # Σ_j w_j |v_j| per head: [H, T, Dv]
        return torch.matmul(w.reshape(hk, h // hk, t, s), vg).reshape(h, t, dv)

    out = torch.matmul(p.reshape(hk, h // hk, t, s), v.to(x.dtype).permute(1, 0, 2)[:, None]).reshape(h, t, dv)
    pa = p * a
    spa = pa.sum(-1)  # [H, T]
    bound = ((pv(pa) + spa[..., None] * out.abs()) / shrink[..., None]
             + (eps / (1 - eps))[..., None] * (pv(p) + out.abs()) + u * out.abs())
    lse_bound = spa / shrink + eps / (1 - eps) + 4 * u * (safe.abs() + m.abs() + 1)
    empty = ~torch.isfinite(lse)
    bound = bound.masked_fill(empty[..., None], 0.0)
    lse_bound = lse_bound.masked_fill(empty, 0.0)
    return bound.permute(1, 0, 2), lse_bound.transpose(0, 1)


F32_U = 2.0 ** -24  # float32's unit roundoff (metrics.unit_roundoff(torch.float32))
F32_RULE = ("float32 rounding bound of attention in any summation order (checks.kernels.attention.rounding_bound: "
            "γ_n in the keys and the head size, Higham §3.1), per element")


def f32_budget(shape: Shape, case: Case, x: dict[str, torch.Tensor],
               variant: Variant = Variant()) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element float32 bounds (out [Tq, H, Dv], lse [H, Tq]) of a case on inputs x. A chunked case is
    merged by LSE from its calls: out = Σ_c w_c out_c with w_c = exp(lse_c - lse), so a call's errors
    reach the result as w_c·(B_c + (Bl_c + Σ_c' w_c' Bl_c')·|out_c|) (to first order), lse's as Σ w_c Bl_c."""
    op = functools.partial(rounding_bound, u=F32_U)
    if not case.chunk:  # (the wrappers fill rows without keys with lse -inf: no error there, bound 0)
        out_b, lse_b = reference(shape, case, x, variant=variant, op=op)
        return out_b, lse_b.clamp_min(0.0)
    kw = dict(scale=variant.scale or shape.scale, window=case.window, softcap=case.softcap, top_left=variant.top_left)
    outs, lses, bounds, lbounds = [], [], [], []
    for k, v, cu_k, causal in chunk_calls(case, x):
        o, l = ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, **kw)
        b, lb = ref.varlen(x["q"], k, v, x["cu_q"], cu_k, causal=causal, op=op, **kw)
        outs.append(o), lses.append(l), bounds.append(b), lbounds.append(lb.clamp_min(0.0))
    _, lse = ref.merge_chunks(outs, lses)  # [H, Tq]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = [torch.exp(l - safe).transpose(0, 1)[..., None] for l in lses]  # [Tq, H, 1] each (0 for empty chunks)
    lse_b = sum(wc[..., 0].transpose(0, 1) * lb for wc, lb in zip(w, lbounds))  # [H, Tq]
    tot = lse_b.transpose(0, 1)[..., None]
    out_b = sum(wc * (b + (lb.transpose(0, 1)[..., None] + tot) * o.abs())
                for wc, b, lb, o in zip(w, bounds, lbounds, outs))
    return out_b, lse_b


@dataclass
class Budget:
    """How far a case's output may be from the reference: `out`, `lse` per element (tensors: the float32
    bound) or as a number (K_FLOOR x the emulated floor), and `rel` over a whole case (None: none)."""

    out: Any
    lse: Any
    rel: Optional[float]
    info: dict[str, Any]

    def within(self, got: torch.Tensor, want: torch.Tensor, rows: Optional[slice] = None) -> bool:
        """got within budget on all rows, or on `rows` (a sequence: the relative L2 is a whole case's)."""
        lim = self.out[rows] if rows is not None and isinstance(self.out, torch.Tensor) else self.out
        if metrics.nonfinite_where_finite(got, want).any():
            return False
        if isinstance(lim, torch.Tensor):
            ok = not metrics.over_budget(got, want, lim.reshape(-1)).any()
        else:
            ok = metrics.max_abs_diff(got, want) <= lim
        return ok and (rows is not None or self.rel is None or metrics.rel_l2(got, want) <= self.rel)

    def lse_within(self, got: torch.Tensor, want: torch.Tensor, scale: float = 1.0) -> bool:
        """got lse within budget (x scale); where the reference has no key (lse -inf) any infinity passes:
        flash-attn 2 writes +inf there, flash-attn 3 -inf (reference.attention_cases)."""
        both_inf = torch.isinf(got) & torch.isinf(want)
        got = torch.where(both_inf, want, got)
        lim = self.lse * scale
        if metrics.nonfinite_where_finite(got, want).any():
            return False
        if isinstance(lim, torch.Tensor):
            return not metrics.over_budget(got, want, lim.reshape(-1)).any()
        return metrics.max_abs_diff(got, want) <= lim


def budget(shape: Shape, case: Case, x: dict[str, torch.Tensor], dtype: torch.dtype, fl: Optional["Floor"],
           variant: Variant = Variant()) -> Budget:
    """float32: the derived rounding bound (the accumulation order is the whole error there, and it is
    the kernel's choice). bfloat16 / float16: K_FLOOR x the emulated floor (module docstring): there the
    kernel's inputs, P and output are rounded to the dtype once each whatever the order, and the float32
    accumulations add errors 2^16 times smaller."""
    if dtype == torch.float32:
        out_b, lse_b = f32_budget(shape, case, x, variant)
        return Budget(out_b, lse_b, None, {"rule": F32_RULE, "bound_max": float(out_b.max()) if out_b.numel() else 0.0,
                                           "lse_bound_max": float(lse_b.max()) if lse_b.numel() else 0.0})
    return Budget(K_FLOOR * fl.out_max, K_FLOOR * fl.lse_max, K_FLOOR * fl.out_rel,
                  {"rule": f"{K_FLOOR:g} x noise floor (max over {FLOOR_SEEDS} seeds of the rounded float64 emulation)",
                   "floor_max_abs": fl.out_max, "floor_rel_l2": fl.out_rel, "floor_lse_max_abs": fl.lse_max,
                   "k": K_FLOOR})


# ----------------------------------------------------------------------------- calling a subject

@dataclass
class Got:
    status: str  # ok | unsupported | raised | crashed | timeout | contract | transport
    message: str = ""
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    seconds: float = 0.0


def _call(iso: Isolated, contract: str, args: list[Any], kwargs: dict[str, Any], out_shape: tuple[int, ...],
          lse_shape: tuple[int, ...]) -> Got:
    dev = next(a.device for a in args if isinstance(a, torch.Tensor))  # where the reference lives
    args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    payload = subj.pack({"args": args, "kwargs": kwargs})
    r: Outcome = iso.call({"contract": contract, "out_shape": list(out_shape), "lse_shape": list(lse_shape),
                           "crc32": zlib.crc32(payload)}, payload)  # both ways checked: a verdict needs intact bytes
    if r.status != "ok":
        return Got(r.status, r.message, seconds=r.seconds)
    if zlib.crc32(r.payload) != r.header.get("crc32"):
        return Got("transport", "the reply's bytes arrived changed (crc32 differs)", seconds=r.seconds)
    res = subj.unpack(r.payload)
    lse = None if res["lse"] is None else res["lse"].to(dev)
    return Got("ok", out=res["out"].to(dev), lse=lse, seconds=r.header.get("seconds", r.seconds))


def run_case(iso: Isolated, shape: Shape, case: Case, x: dict[str, torch.Tensor], dtype: torch.dtype) -> Got:
    """Call the subject on a case (several calls, merged by its LSE, for a chunked case)."""
    c = {n: (v.to(dtype) if v.is_floating_point() else v) for n, v in x.items()}
    kw: dict[str, Any] = {}
    if case.window:
        kw["window_left"] = case.window - 1
    if case.softcap:
        kw["softcap"] = case.softcap
    if case.fp8_cache:  # x's cache is already fp8-representable at this scale: the conversion is exact
        c["kv_cache"] = (x["kv_cache"] / x["kv_scale"]).to(FP8)
        kw["kv_scale"] = float(x["kv_scale"])
    h, tq = shape.n_head, case.total_q
    if case.contract == "prefill":
        def one(k, v, cu_k, causal):
            lens = (cu_k[1:] - cu_k[:-1]).tolist() or [0]
            return _call(iso, "prefill", [c["q"], k, v, c["cu_q"], cu_k, max(t for t, _ in case.seqs), max(lens),
                                          shape.scale, causal], kw, (tq, h, shape.head_dim_v), (h, tq))

        if not case.chunk:
            return one(c["k"], c["v"], c["cu_k"], case.causal)
        parts = [one(k, v, cu_k, causal) for k, v, cu_k, causal in chunk_calls(case, c)]
        bad = next((p for p in parts if p.status != "ok"), None)
        if bad:
            return bad
        if any(p.lse is None for p in parts):
            return Got("unsupported", "returns no lse: chunked prefill cannot merge its partial results")
        out, lse = ref.merge_chunks([p.out.double() for p in parts], [p.lse.double() for p in parts])
        return Got("ok", out=out.to(dtype), lse=lse, seconds=sum(p.seconds for p in parts))
    r = shape.mla.kv_lora_rank
    common = [c["q"], c["kv_cache"], c["block_table"]]
    if case.contract == "mla-decode":
        args = common + [c["seq_lens"], shape.scale, r]
    elif case.contract == "mla-sparse-decode":
        args = common + [c["seq_lens"], c["topk"], shape.scale, r]
    else:
        args = common + [c["cu_q"], c["seq_lens"], c["topk"], shape.scale, r]
    return _call(iso, case.contract, args, kw, (tq, h, r), (h, tq))


# ----------------------------------------------------------------------------- judging

def _seq_spans(case: Case) -> list[slice]:
    spans, at = [], 0
    for t, _ in case.seqs:
        spans.append(slice(at, at + t))
        at += t
    return spans


def _scale_candidates(shape: Shape, case: Case) -> dict[str, float]:
    """Softmax scales a kernel might wrongly use, by the dim they come from."""
    d = _dims(shape, case)
    cands = {f"1/sqrt({d['dqk']}) (q's full width)": d["dqk"] ** -0.5,
             f"1/sqrt({d['dv']}) (the value dim)": d["dv"] ** -0.5}
    if shape.mla:
        m = shape.mla
        cands[f"1/sqrt({m.qk_nope}+{m.qk_rope}) without the YaRN mscale^2"] = m.qk_dim ** -0.5
        cands[f"1/sqrt({m.qk_nope}) (qk_nope only)"] = m.qk_nope ** -0.5
    return {k: v for k, v in cands.items() if not math.isclose(v, shape.scale, rel_tol=1e-9)}


def signature(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: torch.Tensor, fl: Optional[Floor],
              dtype: torch.dtype) -> str:
    """The named mistake whose reference the output matches, or ''. The match budget is the variant's own:
    float32 its rounding bound; otherwise K_FLOOR x the larger of the case's floor and the variant's own
    rounding error on these inputs (P and output rounded to the dtype): a variant's output can be larger
    than the contract's (top-left rows see few keys), and so are its roundings."""
    variants: dict[str, Variant] = {}
    for what, s in _scale_candidates(shape, case).items():
        variants[f"softmax scale from the wrong dim: the output equals attention with scale {what} = {s:.6g} "
                 f"instead of the contract's {shape.scale:.6g}"] = Variant(scale=s)
    if case.causal and any(t < s for t, s in case.seqs):
        variants["top-left causal alignment: the queries were placed at the FIRST q_len positions "
                 "(SDPA's is_causal) instead of the last (bottom-right)"] = Variant(top_left=True)
    if shape.mla and case.contract != "prefill":
        m = shape.mla
        variants[f"V not taken from the latent: the output equals V = cache[..., {m.qk_rope}:] instead of the "
                 f"latent cache[..., :{m.kv_lora_rank}]"] = Variant(v_from=m.qk_rope)
    for name, v in variants.items():
        want, _ = reference(shape, case, x, variant=v)
        if dtype == torch.float32:
            own = budget(shape, case, x, dtype, None, v)
        else:
            emu, _ = reference(shape, case, _rounded(x, dtype), p_dtype=dtype, out_dtype=dtype, variant=v)
            own = Budget(K_FLOOR * max(fl.out_max, metrics.max_abs_diff(emu, want)), 0.0,
                         K_FLOOR * max(fl.out_rel, metrics.rel_l2(emu, want)), {})
        if own.within(got, want):
            return name
    return ""


DUPLICATES = ("a top-k row naming one position twice, which no indexer emits (vLLM's indexer: torch.topk gives "
              "distinct positions); kernels differ there")


def probe(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: Got, dtype: torch.dtype, fl: Optional[Floor],
          subject: str, target: str, info: dict[str, Any]) -> Finding:
    """An undefined input probed on purpose: what the kernel did, as information (status pass, never a fault)."""
    note = {"informational": True, "probe": case.probe}
    if got.status != "ok":
        return Finding(CHECK, subject, target, "pass", metrics={**info, **note},
                       reason=f"information, not judged: on {DUPLICATES}, the kernel {got.status}: {got.message}")
    out = got.out.double()
    said = []
    for how, words in (("each", "counts a duplicate as often as it is listed (as kernels that iterate the list, "
                                "e.g. FlashMLA's kv[indices])"),
                       ("once", "counts a duplicate once (as mask-based kernels, e.g. llama.cpp's DSA mask)")):
        want, _ = reference(shape, case, x, duplicates=how)
        note[f"max_abs_diff_{how}"] = metrics.max_abs_diff(out, want)
        if budget(shape, case, x, dtype, fl).within(out, want):
            said.append(words)
    what = " and ".join(said) or "matches neither way of counting it"
    return Finding(CHECK, subject, target, "pass", reason=f"information, not judged: on {DUPLICATES}, the kernel {what}",
                   metrics={**info, **note})


def judge(shape: Shape, case: Case, x: dict[str, torch.Tensor], got: Got, fl: Optional[Floor], dtype_name: str,
          subject: str) -> Finding:
    """One case's finding: metrics, budget, per-sequence pattern and signature."""
    target = f"{case.name}/{dtype_name}"
    dims = _dims(shape, case)
    dtype = getattr(torch, dtype_name)
    info = {"contract": case.contract, "dtype": dtype_name, "seqs": [list(s) for s in case.seqs],
            "chunked": bool(case.chunk), "heads": [shape.n_head, shape.n_head_kv], **dims}
    if case.probe:
        return probe(shape, case, x, got, dtype, fl, subject, target, info)
    if got.status in ("unsupported", "transport"):  # transport: llmdoctor's own bytes changed, no verdict
        return Finding(CHECK, subject, target, "skip", reason=got.message, metrics=info)
    if got.status != "ok":
        what = {"raised": "kernel raised", "crashed": "kernel crashed", "timeout": "kernel hung",
                "contract": "contract violation"}.get(got.status, got.status)
        return Finding(CHECK, subject, target, "fail", reason=f"{what}: {got.message}", metrics=info,
                       explanation=f"{what} on case {case.name} ({dtype_name}); the check went on")
    want, want_lse = reference(shape, case, x)
    out = got.out.double()
    bud = budget(shape, case, x, dtype, fl)
    mets = {**info, "max_abs_diff": metrics.max_abs_diff(out, want), "rel_l2": metrics.rel_l2(out, want),
            "nonfinite": int((~torch.isfinite(out)).sum()), "kernel_seconds": got.seconds}
    if isinstance(bud.out, torch.Tensor):  # how much of the per-element bound the worst element uses
        err = metrics.abs_diff(out, want)
        lim = bud.out.detach().to("cpu", torch.float64).reshape(-1)  # abs_diff's values are on the CPU
        used = err[lim > 0] / lim[lim > 0]
        mets["bound_used"] = float(used.max()) if used.numel() else 0.0
    per_seq = [bud.within(out[sp], want[sp], sp) for sp in _seq_spans(case)]
    lse_ok = True
    if got.lse is not None:
        lg = got.lse.double()
        fin = torch.isfinite(want_lse)
        mets["lse_max_abs_diff"] = metrics.max_abs_diff(lg[fin], want_lse[fin])
        lse_ok = bud.lse_within(lg, want_lse)
    mets["failing_sequences"] = [b for b, ok in enumerate(per_seq) if not ok]
    out_ok = all(per_seq) and bud.within(out, want)
    if out_ok and lse_ok:
        return Finding(CHECK, subject, target, "pass", reason="within budget", metrics=mets, budget=bud.info)
    if out_ok:
        log2 = bud.lse_within(got.lse.double(), want_lse / LN2, 1 / LN2)
        sig = "LSE in log2 instead of natural log: lse equals the reference's / ln 2" if log2 else ""
        return Finding(CHECK, subject, target, "fail", reason=f"lse wrong{': ' + sig if sig else ''}", metrics=mets,
                       budget=bud.info, explanation=sig or "the output is right but the returned lse is not",
                       evidence=[{"signature": sig}] if sig else [])
    pattern = seq_pattern(case, per_seq)
    sig = signature(shape, case, x, out, fl, dtype)
    nan = bool(mets["nonfinite"] and metrics.nonfinite_where_finite(out, want).any())
    mets["nonfinite_where_finite"] = nan
    over = (f"error {mets['max_abs_diff']:.3g} beyond the float32 rounding bound (worst element at "
            f"{mets['bound_used']:.3g} x its bound)" if "bound_used" in mets else
            f"error {mets['max_abs_diff']:.3g} > {K_FLOOR:g} x floor {fl.out_max:.3g}")
    reason = "; ".join(filter(None, ["NaN/inf in the output where the reference is finite" if nan else over,
                                     pattern, sig]))
    expl = sig or pattern or "unexplained: no named signature reproduces the output"
    if nan and not sig:
        expl = "NaN/inf where the reference is finite: " + (pattern or (
            "unused cache pages and out= buffers are NaN here, so the kernel read beyond seq_len or left "
            "elements unwritten"))
    return Finding(CHECK, subject, target, "fail", reason=reason, metrics=mets, budget=bud.info, explanation=expl,
                   evidence=[{"pattern": pattern, "signature": sig}])


def unused_rows_verdict(first: Finding, follow: Finding) -> Finding:
    """A paged case whose output had NaN where the reference is finite, judged again with its unused cache
    rows finite (`stale_unused_rows`). Within budget then: the kernel weighs the rows past seq_len by zero
    and NaN there reaches the output (0 x NaN), as flash-attn's paged kernels may (their tests fill caches
    with finite values; engines zero-fill theirs): information, not judged. Still failing: the first
    verdict stands, with what the follow-up saw."""
    if follow.status == "pass":
        return dataclasses.replace(
            follow, reason=("within budget with finite rows past seq_len (a reused page's); information, not judged: "
                            f"with NaN there the output has {first.metrics['nonfinite']} NaN/inf: the kernel weighs "
                            "rows past seq_len by zero (0 x NaN), as flash-attn's paged kernels may; engines "
                            "zero-fill their caches"),
            metrics={**follow.metrics, "unused_rows": "weighed by zero: NaN there reaches the output",
                     "nonfinite_with_nan_unused_rows": first.metrics["nonfinite"]})
    return dataclasses.replace(first, explanation=f"{first.explanation}; with finite rows past seq_len it still "
                                                  f"fails: {follow.reason}")


def seq_pattern(case: Case, per_seq: list[bool]) -> str:
    """Which sequences of a batch fail, in words ('' when it says nothing more than 'all').

    A predicate is reported when it separates the failing sequences from the passing ones exactly.
    Sequences with at most one key are left out of the passing side except for the kv_len-0
    predicate: one key makes the softmax 1 whatever the scale, mask or offset, so they pass even
    under most bugs and would blur every other pattern."""
    bad = [b for b, ok in enumerate(per_seq) if not ok]
    if not bad or len(per_seq) == 1:
        return ""
    paged = case.contract != "prefill"
    attrs: list[tuple[str, Callable[[int], bool]]] = [
        ("only sequences with kv_len 0 fail (an empty key range must give out 0 and an infinite lse)",
         lambda b: case.seqs[b][1] == 0),
        ("only sequences with q_len < k_len fail", lambda b: case.seqs[b][0] < case.seqs[b][1] and not paged),
        ("only sequences whose length is not a multiple of the block size fail (the last page's unused tail?)",
         lambda b: paged and case.seqs[b][1] % case.block_size != 0),
        ("only sequences with q_len 1 fail", lambda b: case.seqs[b][0] == 1 and not paged),
        ("only sequences after the first fail (per-sequence offsets?)", lambda b: b > 0),
    ]
    good_keys = [case.seqs[b][1] for b, ok in enumerate(per_seq) if ok and case.seqs[b][1] > 1]
    if good_keys:
        attrs.append((f"only sequences with more than {max(good_keys)} keys fail (keys beyond a limit dropped?)",
                      lambda b: case.seqs[b][1] > max(good_keys)))
    for i, (words, pred) in enumerate(attrs):
        good = [b for b, ok in enumerate(per_seq) if ok and (i == 0 or case.seqs[b][1] > 1)]
        if good and all(pred(b) for b in bad) and not any(pred(b) for b in good):
            return words
    return "" if len(bad) == len(per_seq) else f"sequences {bad} of {len(per_seq)} fail"


def subject_patterns(findings: list[Finding]) -> list[str]:
    """Across a subject's cases: a failure confined to one dtype, head size, contract or chunked mode."""
    judged = [f for f in findings if f.status != "skip" and "contract" in f.metrics]
    bad = [f for f in judged if f.status == "fail"]
    if not bad or len(bad) == len(judged):
        return []
    out = []
    for key, words in (("dtype", "only dtype {} fails"), ("dqk", "only head size {} fails"),
                       ("contract", "only the {} contract fails"), ("chunked", "only chunked mode fails")):
        vals = {f.metrics.get(key) for f in bad}
        others = {f.metrics.get(key) for f in judged if f.status == "pass"}
        if len(vals) == 1 and others and not (vals & others):
            v = vals.pop()
            if key == "chunked" and not v:
                continue
            out.append(words.format(v))
    return out


# ----------------------------------------------------------------------------- consistency

def consistency(iso: Isolated, shape: Shape, dtype: torch.dtype, dtype_name: str, subject: str,
                contracts: set[str], seed: int, dev: str = "cpu") -> list[Finding]:
    """prefill row t == decode at t (dense and sparse); absorbed MLA == naive MLA (when the subject has
    both contracts)."""
    out: list[Finding] = []
    if "prefill" in contracts:
        L = 29
        full = Case("prefill-vs-decode", "prefill", ((L, L),))
        rows = (0, L // 2, L - 1)
        step = Case("prefill-vs-decode", "prefill", tuple((1, t + 1) for t in rows))
        out.append(_pair(iso, shape, dtype, dtype_name, subject, "prefill-row-vs-decode", full, step,
                         lambda xa: _decode_inputs(xa, rows), lambda o: o[list(rows)], seed, dev))
    if "prefill" in contracts and "mla-decode" in contracts and shape.mla:
        out.append(_absorbed_vs_naive(iso, shape, dtype, dtype_name, subject, seed, dev))
    if {"mla-sparse-prefill", "mla-sparse-decode"} <= contracts and shape.top_k:
        t, n, k = 9, 40, min(shape.top_k, TOPK)
        rows = (0, t // 2, t - 1)
        full = Case("sparse-prefill-vs-decode", "mla-sparse-prefill", ((t, n),), top_k=k)
        step = Case("sparse-prefill-vs-decode", "mla-sparse-decode", tuple((1, n - t + r + 1) for r in rows), top_k=k)
        out.append(_pair(iso, shape, dtype, dtype_name, subject, "sparse-prefill-row-vs-decode", full, step,
                         lambda xa: _sparse_decode_inputs(xa, rows, n - t), lambda o: o[list(rows)], seed, dev))
    return out


def _sparse_decode_inputs(x: dict[str, torch.Tensor], rows: tuple[int, ...], ctx: int) -> dict[str, torch.Tensor]:
    """The sparse decode steps of the given query rows of a one-sequence sparse prefill (same cache,
    same top-k rows; query r sits at position ctx + r, so its seq_len is ctx + r + 1)."""
    dev = x["q"].device
    return {"q": x["q"][list(rows)], "kv_cache": x["kv_cache"], "block_table": x["block_table"][[0] * len(rows)],
            "seq_lens": torch.tensor([ctx + r + 1 for r in rows], dtype=torch.int32, device=dev),
            "cu_q": torch.arange(len(rows) + 1, dtype=torch.int32, device=dev), "topk": x["topk"][list(rows)]}


def _decode_inputs(x: dict[str, torch.Tensor], rows: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """The decode-step inputs of the given rows of a one-sequence causal prefill."""
    k = torch.cat([x["k"][: t + 1] for t in rows])
    v = torch.cat([x["v"][: t + 1] for t in rows])
    lens = torch.tensor([t + 1 for t in rows], device=k.device)
    return {"q": x["q"][list(rows)], "k": k, "v": v,
            "cu_q": torch.arange(len(rows) + 1, dtype=torch.int32, device=k.device),
            "cu_k": torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)}


def _pair(iso, shape, dtype, dtype_name, subject, name, case_a, case_b, derive, select, seed, dev) -> Finding:
    """Two subject calls that must agree. float32: within the sum of the two calls' rounding bounds on
    these inputs; otherwise K_FLOOR x max over seeds of the summed emulation errors."""
    xa = make_inputs(shape, case_a, seed, dev)
    if dtype == torch.float32:
        limit = select(f32_budget(shape, case_a, xa)[0]) + f32_budget(shape, case_b, derive(xa))[0]
    else:
        floor = 0.0
        for s in range(FLOOR_SEEDS):
            xs = make_inputs(shape, case_a, 20_000 + s, dev)
            xb = derive(xs)
            ea = select(reference(shape, case_a, _rounded(xs, dtype), p_dtype=dtype, out_dtype=dtype)[0])
            eb = reference(shape, case_b, _rounded(xb, dtype), p_dtype=dtype, out_dtype=dtype)[0]
            wa = select(reference(shape, case_a, xs)[0])
            floor = max(floor, float(((ea - wa).abs() + (eb - wa).abs()).max()))
        limit = K_FLOOR * floor
    ga, gb = run_case(iso, shape, case_a, xa, dtype), run_case(iso, shape, case_b, derive(xa), dtype)
    return _agree(subject, f"{name}/{dtype_name}", ga, gb, select, limit, dtype_name)


def _agree(subject: str, target: str, ga: Got, gb: Got, select: Optional[Callable], limit: Any,
           dtype_name: str) -> Finding:
    """limit: per-element tensor (float32: the two paths' summed rounding bounds) or K_FLOOR x floor."""
    info = {"dtype": dtype_name, "consistency": True}
    bad = next((g for g in (ga, gb) if g.status != "ok"), None)
    if bad is not None:
        status = "skip" if bad.status in ("unsupported", "transport") else "fail"
        return Finding(CHECK, subject, target, status, reason=f"{bad.status}: {bad.message}", metrics=info)
    a, b = select(ga.out.double()) if select else ga.out.double(), gb.out.double()
    d = metrics.max_abs_diff(a, b)
    if isinstance(limit, torch.Tensor):
        ok = not metrics.over_budget(a, b, limit.reshape(-1)).any()
        words, rule = f"the two calls' float32 rounding bounds (max {float(limit.max()):.3g})", F32_RULE + ", summed"
        bud = {"rule": rule, "bound_max": float(limit.max())}
    else:
        ok = not (torch.isnan(a).any() or torch.isnan(b).any()) and d <= limit
        words = f"budget {K_FLOOR:g} x {limit / K_FLOOR:.3g}"
        bud = {"rule": f"{K_FLOOR:g} x max over seeds of the two rounded emulations' summed errors",
               "floor": limit / K_FLOOR}
    return Finding(CHECK, subject, target, "pass" if ok else "fail",
                   reason=f"the two paths differ by {d:.3g} ({words})", metrics={**info, "max_abs_diff": d},
                   budget=bud, explanation="" if ok else "the subject disagrees with itself between two equivalent call paths")


def _absorbed_vs_naive(iso: Isolated, shape: Shape, dtype: torch.dtype, dtype_name: str, subject: str,
                       seed: int, dev: str) -> Finding:
    """Decode of B sequences as naive MLA (prefill on decompressed K/V) and absorbed MLA (mla-decode on the
    latent cache, then v_b): both must give the same [B, H, Dv]."""
    m = shape.mla
    dec = Case("absorbed", "mla-decode", ((1, 21), (1, 40)))
    naive_case = Case("naive", "prefill", dec.seqs)

    def build(s: int) -> tuple[dict, dict, torch.Tensor]:
        gen = torch.Generator().manual_seed(s)
        x = make_inputs(shape, dec, s)  # drawn and built on the CPU, moved below
        k_b = torch.randn(shape.n_head, m.kv_lora_rank, m.qk_nope, generator=gen, dtype=torch.float64) / m.kv_lora_rank ** 0.5
        v_b = torch.randn(shape.n_head, m.v_dim, m.kv_lora_rank, generator=gen, dtype=torch.float64) / m.kv_lora_rank ** 0.5
        q_nope = torch.randn(len(dec.seqs), shape.n_head, m.qk_nope, generator=gen, dtype=torch.float64)
        q_pe = torch.randn(len(dec.seqs), shape.n_head, m.qk_rope, generator=gen, dtype=torch.float64)
        x["q"] = mla_ref.absorb_q(q_nope, q_pe, k_b)  # [B, H, R+Dr]
        ks, vs = [], []
        for b, (_, n) in enumerate(dec.seqs):
            rows = ref.gather_pages(x["kv_cache"], x["block_table"][b], n)  # [n, R+Dr]
            k_nope, v = mla_ref.decompress(rows[:, :m.kv_lora_rank], k_b, v_b)
            ks.append(torch.cat([k_nope, rows[:, None, m.kv_lora_rank:].expand(-1, shape.n_head, -1)], -1))
            vs.append(v)
        lens = torch.tensor([n for _, n in dec.seqs])
        xn = {"q": torch.cat([q_nope, q_pe], -1), "k": torch.cat(ks), "v": torch.cat(vs), "cu_q": x["cu_q"],
              "cu_k": torch.nn.functional.pad(lens.cumsum(0), (1, 0)).to(torch.int32)}
        return ({n: t.to(dev) for n, t in x.items()}, {n: t.to(dev) for n, t in xn.items()}, v_b.to(dev))

    def up(o: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bhr,hvr->bhv", o, v_b)

    x, xn, v_b = build(seed)
    if dtype == torch.float32:  # the latent bound carried through |v_b| (the up-projection is ours, float64)
        limit = up(f32_budget(shape, dec, x)[0], v_b.abs()) + f32_budget(shape, naive_case, xn)[0]
    else:
        floor = 0.0
        for s in range(FLOOR_SEEDS):
            xs, xns, v_bs = build(20_000 + s)
            want = reference(shape, naive_case, xns)[0]
            ea = up(reference(shape, dec, _rounded(xs, dtype), p_dtype=dtype, out_dtype=dtype)[0], v_bs)
            en = reference(shape, naive_case, _rounded(xns, dtype), p_dtype=dtype, out_dtype=dtype)[0]
            floor = max(floor, float(((ea - want).abs() + (en - want).abs()).max()))
        limit = K_FLOOR * floor
    ga = run_case(iso, shape, dec, x, dtype)
    gn = run_case(iso, shape, naive_case, xn, dtype)
    if ga.status == "ok":
        ga.out = up(ga.out.double(), v_b)
    return _agree(subject, f"absorbed-vs-naive/{dtype_name}", ga, gn, None, limit, dtype_name)


# ----------------------------------------------------------------------------- the run

@dataclass
class Result:
    shape: Shape
    device: str
    findings: list[Finding] = field(default_factory=list)
    patterns: dict[str, list[str]] = field(default_factory=dict)
    subjects: dict[str, dict[str, Any]] = field(default_factory=dict)
    seconds: float = 0.0


def run(shape: Shape, subjects: list[tuple[str, Optional[str]]], *, device: str = "cpu",
        dtypes: tuple[str, ...] = DTYPES, explicit: tuple[str, ...] = (), timeout: float = 300.0, seed: int = 0,
        only: Optional[set[str]] = None, on_step: Optional[Callable[[str], None]] = None) -> Result:
    """Run every case of `shape` through each (spec, contract or None) subject. `explicit` names the
    subjects the user asked for by name (their load failure is a failure to run: exit 2)."""
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
    for d in dtypes:
        if d not in DTYPES:
            raise InputError(f"--dtype {d!r}: expected one of {', '.join(DTYPES)}")
    res = Result(shape, device)
    t0 = time.perf_counter()
    all_cases = [c for c in cases(shape) if only is None or c.name in only]
    floors: dict[tuple[str, str], Optional[Floor]] = {}
    dev = "cuda" if device == "cuda" else "cpu"
    shapes = {c.name: shape_for(shape, c) for c in all_cases}
    inputs = {c.name: make_inputs(shapes[c.name], c, case_seed(seed, c), dev) for c in all_cases}
    inputs |= {c.name: fp8_cache(inputs[c.name]) for c in all_cases if c.fp8_cache}
    for spec, contract in subjects:
        label = spec if contract is None else f"{spec} ({contract})"
        st = time.perf_counter()
        found: list[Finding] = []
        with Isolated("llmdoctor.subjects.attention:serve", (spec, device, contract), call_timeout=timeout) as iso:
            try:
                iso.start()
            except LoadFailed as e:
                if e.kind == "InputError":
                    raise InputError(str(e)) from None
                res.findings.append(Finding(CHECK, label, "load", "skip", reason=f"{label} could not run: {e}"))
                res.subjects[label] = {"loaded": False, "reason": str(e)}
                continue
            mine = [c for c in all_cases if contract is None or c.contract == contract]
            has: set[str] = set()
            for dname in dtypes:
                dtype = getattr(torch, dname)
                for case in mine:
                    if on_step:
                        on_step(f"{label}: {case.name} {dname}")
                    key, sh = (case.name, dname), shapes[case.name]
                    if key not in floors:  # float32 is judged by its derived bound, not an emulated floor
                        floors[key] = None if dtype == torch.float32 else noise_floor(sh, case, dtype, dev)
                    got = run_case(iso, sh, case, inputs[case.name], dtype)
                    f = judge(sh, case, inputs[case.name], got, floors[key], dname, label)
                    if case.contract != "prefill" and f.status == "fail" and f.metrics.get("nonfinite_where_finite"):
                        x2 = stale_unused_rows(inputs[case.name], case_seed(seed, case) + 1)
                        f = unused_rows_verdict(f, judge(sh, case, x2, run_case(iso, sh, case, x2, dtype),
                                                         floors[key], dname, label))
                    if not case.probe and (f.status != "skip" or "has no" not in f.reason):
                        has.add(case.contract)
                    found.append(f)
                if only is None:
                    found += consistency(iso, shape, dtype, dname, label, has, seed, dev)
            res.subjects[label] = {"loaded": True, "restarts": iso.restarts, "seconds": time.perf_counter() - st}
        res.findings += found
        pats = subject_patterns(found)
        if pats:
            res.patterns[label] = pats
    res.seconds = time.perf_counter() - t0
    return res


def builtin_subjects(names: str, device: str, shape: Optional[Shape] = None) -> list[tuple[str, Optional[str]]]:
    """--subjects all | comma list of built-in names (a group name stands for its members). With `shape`,
    a built-in whose contracts are fixed (vLLM's MLA kernels) is left out where the shape has none of them."""
    if names == "all":
        picked = list(subj.BUILTINS)
    else:
        picked = []
        for n in (n.strip() for n in names.split(",") if n.strip()):
            if n not in subj.BUILTINS:
                raise InputError(f"--subjects {n!r}: expected all or some of {', '.join(subj.BUILTINS)}")
            picked += [m for m in subj.GROUPS.get(n, (n,)) if m not in picked]
    has = None if shape is None else {c.contract for c in cases(shape)}
    return [(n, None) for n in picked if has is None or n not in subj.VLLM_MLA or has & set(subj.VLLM_MLA[n])]


def engine_explainer(shape: Shape, dtype: str) -> dict[str, Any]:
    """Which attention backends the engine that selects them at run time (vLLM) selects for this shape
    and dtype: its own selection code, asked through the engine interface; {"skipped": why} elsewhere."""
    from ...subjects.engines import engine_class, selectable
    from ...subjects.engines.base import Deployment, EngineError, EngineUnavailable

    m = shape.mla
    head = (m.kv_lora_rank + m.qk_rope) if m else shape.head_dim
    engine = next(engine_class(n) for n in selectable() if engine_class(n).traits.selects_backends)(Deployment())
    try:
        return engine.select_backend(head, dtype, use_mla=m is not None, use_sparse=bool(shape.top_k))
    except EngineUnavailable as e:
        return {"skipped": f"{engine.title} is not available: {e}"}
    except EngineError as e:
        return {"skipped": f"{engine.title}'s selection could not run: {e}"}


def count_line(findings: list[Finding]) -> str:
    from ..base import count

    c = count(findings)
    return f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
