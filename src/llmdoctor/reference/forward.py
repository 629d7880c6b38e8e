"""The reference forward pass: layer streaming over a GGUF mmap (or an HF checkpoint's safetensors,
reference/checkpoint.py), activation capture, overflow stats.

Weights are dequantized from the read-only mmap one block at a time and dropped after the block ran
(`cache=True` keeps them), so peak memory is about one block + the activations + a slice of the output
matrix: token embeddings are gathered row by row and the output projection runs over `vocab_chunk`
vocabulary rows at a time.

Capture points (names follow llama.cpp's graph callback names, `cb(cur, "name", il)`, so an engine's
nodes map onto them; `{i}` is the layer index):

    inp_scaled        [T, n_embd]   token embeddings after the embedding scale (gemma)
    attn_norm-{i}     [T, n_embd]   input of the attention (after the pre-attention RMSNorm)
    Qcur-{i}          [T, H, D]     queries after q-norm and RoPE, before the attention scale
    Kcur-{i}          [T, Hk, D]    keys after k-norm and RoPE
    Vcur-{i}          [T, Hk, Dv]   values
    kqv_out-{i}       [T, H*Dv]     attention output, before the output projection
    attn_out-{i}      [T, n_embd]   after the output projection
    attn_post_norm-{i} [T, n_embd]  after the post-attention norm (gemma)
    ffn_inp-{i}       [T, n_embd]   residual stream after attention (gemma3's graph calls it sa_out)
    ffn_norm-{i}      [T, n_embd]   input of the FFN
    ffn_moe_topk-{i}  [T, k]        experts chosen (MoE blocks)
    ffn_out-{i}       [T, n_embd]   FFN output (before gemma's post-FFW norm)
    ffn_post_norm-{i} [T, n_embd]   after the post-FFW norm (gemma)
    l_out-{i}         [T, n_embd]   layer output (residual stream)
    result_norm       [T, n_embd]   after the final norm
    result_output     [T, n_vocab]  the logits (after the final softcap, if any)

`capture` takes names or fnmatch patterns (`"l_out-*"`, `"*"`). Every run records, per layer, the max
|activation| over all the points above (finite values), which point held it, and the inf/NaN counts
(`model.stats`): the way float16 overflow shows up.

Blocks are registered per architecture (`register_block`); the dense block here serves llama, qwen2,
qwen3 and gemma3. A block gets a `Step` (the layer's weights, positions, capture hook) and the residual
stream x [T, n_embd], and returns the new residual stream.
"""

from __future__ import annotations

import fnmatch
from contextlib import contextmanager
from contextvars import ContextVar
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F
from gguf import MODEL_TENSOR, TENSOR_NAMES

from ..errors import InputError
from ..gguf import open_gguf
from . import attention as attn
from .checkpoint import Checkpoint, CheckpointWeights
from .config import ModelConfig, from_gguf
from .device_cache import DeviceBudget, DeviceCache, minimum_bytes
from .emulate import EnginePrecision, KVCacheFP8, fp8_blocks, half_dequant, quantize_activations, tf32, tf32_weights
from .stages import stage


# ---- weights ------------------------------------------------------------------------------------

def dequantize_raw(raw: np.ndarray, qtype: int, shape: tuple[int, ...], *, device: str | torch.device) -> torch.Tensor:
    """float32 [*shape] from a tensor's raw bytes: llmdoctor's dequantizer, or gguf-py's for a type
    ours does not cover yet (the two are bit-exact by the dequantizer's contract)."""
    from ..gguf import dequantize

    try:
        return dequantize(raw, int(qtype), tuple(shape), device=device)
    except InputError as e:
        if "no dequantizer" not in str(e):
            raise
    from gguf.quants import dequantize as gguf_dequantize

    rows = raw.reshape(int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1, -1)
    return torch.from_numpy(gguf_dequantize(rows, qtype).reshape(shape)).to(device)


class Weights:
    """Dequantized tensors of one GGUF, on demand, in the run's dtype and device.

    Every tensor handed out is remembered with its GGML type (by storage address, which is unique
    while the tensor is alive) so that `linear` can reproduce an engine's activation quantization
    for it when a run emulates one (reference/emulate.py). The other weight sources a `Step` may hold
    offer the same methods: checkpoint.CheckpointWeights (an HF checkpoint), tensor_parallel.RankWeights.
    """

    def __init__(self, g, *, dtype: torch.dtype, device: torch.device, cache: bool,
                 dequantizer: Callable[..., torch.Tensor] | None = None, budget: DeviceBudget | None = None):
        self.g, self.dtype, self.device, self.cache = g, dtype, device, cache
        # (raw, qtype, shape, device=) -> float tensor: ours by default; op substitution swaps in a
        # suspect kernel (subjects/kernels.py KernelDequantizer)
        self.dequantize = self._decoding(dequantizer or dequantize_raw)
        self.qtypes: dict[int, int] = {}  # data_ptr -> GGML type
        self.raws: dict[int, np.ndarray] = {}  # data_ptr -> the tensor's bytes (an emulated engine may read its blocks)
        self._names = {t.name for t in g.tensors}
        self._cached = DeviceCache(budget)  # within the device budget (reference/device_cache.py)
        self.budget = self._cached.budget

    def _decoding(self, dequantize: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`dequantize` into the run's dtype, timed as the "decode" stage, each tensor it makes counted
        against the device budget while it lives."""
        def run(raw, qtype, shape, *, device):
            with stage("decode"):
                return self.budget.track(dequantize(raw, qtype, shape, device=device).to(self.dtype))

        return run

    def fits(self, name: str) -> bool:
        """Whether tensor `name` may be dequantized whole within the device budget."""
        t = self.g.tensor(name)
        return self.budget.fits_transient(int(np.prod(t.shape, dtype=np.int64)) * self.dtype.itemsize)

    def _remember(self, w: torch.Tensor, qtype: int, raw: np.ndarray | None = None) -> torch.Tensor:
        self.qtypes[w.data_ptr()] = int(qtype)
        if raw is None:
            self.raws.pop(w.data_ptr(), None)  # an address reused by a tensor no bytes describe
        else:
            self.raws[w.data_ptr()] = raw
        return w

    def has(self, name: str) -> bool:
        return name in self._names

    def replace(self, name: str, value: torch.Tensor) -> None:
        """Op substitution: from now on `name` is `value` (an engine's version of that tensor, in the file's
        layout), as if the file held it; its GGML type stays the file's (for an emulated run's rounding)."""
        w = value.to(device=self.device, dtype=self.dtype)
        self._cached.pin(name, self._remember(w, self.g.tensor(name).type))

    def get(self, name: str) -> torch.Tensor:
        w = self._cached.get(name)
        if w is None:
            t = self.g.tensor(name)
            w = self.dequantize(t.data, t.type, t.shape, device=self.device).to(self.dtype)
            if self.cache:
                self._cached[name] = w
            self._remember(w, t.type, t.data)
        return w

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor, dequantizing only those rows (embedding lookup)."""
        t = self.g.tensor(name)
        if name in self._cached:
            return self._remember(self._cached[name][ids.to(self.device)], t.type)
        n_rows, row_len = t.shape
        raw = t.data.reshape(n_rows, -1)[ids.cpu().numpy()]  # [len(ids), row_bytes]
        return self._remember(self.dequantize(raw, t.type, (len(ids), row_len), device=self.device).to(self.dtype),
                              t.type)

    def slab(self, name: str, i: int) -> torch.Tensor:
        """Slab i along the slowest dim (one expert of a merged [E, out, in] expert tensor), dequantizing
        only that slab's bytes: an MoE layer never holds all its experts at once."""
        t = self.g.tensor(name)
        raw = t.data.reshape(t.shape[0], -1)[i]
        if name in self._cached:
            return self._remember(self._cached[name][i], t.type, raw)
        w = self.dequantize(raw, t.type, tuple(t.shape[1:]), device=self.device).to(self.dtype)
        return self._remember(w, t.type, raw)

    def row_slices(self, name: str, chunk: int) -> Iterable[torch.Tensor]:
        """A 2-D tensor in slices of `chunk` rows (the output projection over the vocabulary)."""
        t = self.g.tensor(name)
        n_rows, row_len = t.shape
        raw = t.data.reshape(n_rows, -1)
        if name in self._cached or self.cache and self.budget.admits(n_rows * row_len * self.dtype.itemsize):
            for r, part in zip(range(0, n_rows, chunk), self.get(name).split(chunk)):
                yield self._remember(part, t.type, raw[r:r + chunk])
            return
        for r in range(0, n_rows, chunk):
            part = raw[r:r + chunk]
            w = self.dequantize(part, t.type, (part.shape[0], row_len), device=self.device).to(self.dtype)
            yield self._remember(w, t.type, part)


def tensor_name(kind: MODEL_TENSOR, il: int | None = None, suffix: str = "weight") -> str:
    """GGUF tensor name from gguf-py's table: (ATTN_Q, 3) -> "blk.3.attn_q.weight"."""
    return TENSOR_NAMES[kind].format(bid=il) + "." + suffix


# ---- activation capture and stats ---------------------------------------------------------------

@dataclass
class LayerStats:
    layer: int  # -1: the embeddings, n_layer: the output head (final norm, logits)
    max_abs: float = 0.0  # over finite values of every capture point of the layer
    max_at: str = ""  # the point that held it
    n_inf: int = 0
    n_nan: int = 0
    first_nonfinite: str = ""  # first point with an inf or NaN

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Recorder:
    """Keeps the requested activations and always updates the per-layer stats."""

    def __init__(self, capture: Iterable[str] | None, to: torch.device | None = None):
        self.patterns = set(capture or ())
        self.to = to  # where captures are kept (None: where they were computed)
        self.captured: dict[str, torch.Tensor] = {}
        self.stats: dict[int, LayerStats] = {}

    def wants(self, name: str) -> bool:
        return name in self.patterns or any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def __call__(self, name: str, x: torch.Tensor, il: int = -1, slot: int | None = None) -> None:
        """Record point `name` of layer `il` (-1: outside the blocks, named without a suffix); its stats
        go to layer `slot` (default `il`; the model's head uses n_layer)."""
        full = f"{name}-{il}" if il >= 0 else name
        slot = il if slot is None else slot
        st = self.stats.setdefault(slot, LayerStats(slot))
        m = float(x.abs().amax())  # NaN and inf propagate: one pass in the common all-finite case
        if not math.isfinite(m):
            finite = torch.isfinite(x)
            n_nan = int(torch.isnan(x).sum())
            st.n_nan += n_nan
            st.n_inf += int((~finite).sum()) - n_nan
            st.first_nonfinite = st.first_nonfinite or full
            m = float(x.abs().masked_fill(~finite, 0).amax())
        if m > st.max_abs:
            st.max_abs, st.max_at = m, full
        if self.wants(full):
            self.captured[full] = x.detach() if self.to is None else x.detach().to(self.to)


# ---- the step a block sees ----------------------------------------------------------------------

@dataclass
class Step:
    """One layer's context: config, weights of layer `il`, positions [T], the capture hook."""

    cfg: ModelConfig
    il: int
    positions: torch.Tensor
    weights: Weights
    record: Recorder
    kv_chunk: int | None = None
    extra: dict = field(default_factory=dict)  # per-run state other blocks may need

    def w(self, kind: MODEL_TENSOR, suffix: str = "weight") -> torch.Tensor:
        return self.weights.get(tensor_name(kind, self.il, suffix))

    def has(self, kind: MODEL_TENSOR, suffix: str = "weight") -> bool:
        return self.weights.has(tensor_name(kind, self.il, suffix))

    def cap(self, name: str, x: torch.Tensor) -> torch.Tensor:
        self.record(name, x, self.il)
        return x


Block = Callable[[Step, torch.Tensor], torch.Tensor]
_BLOCKS: dict[str, Block] = {}


def register_block(*archs: str) -> Callable[[Block], Block]:
    def deco(fn: Block) -> Block:
        for a in archs:
            _BLOCKS[a] = fn
        return fn

    return deco


# ---- math pieces --------------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last dim, in the accumulation dtype (llama.cpp
    ggml_rms_norm + ggml_mul; transformers' *RMSNorm upcast to float32). The weight is used as stored:
    for gemma the converter already folded HF's (1 + w) into it."""
    acc = attn.acc_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.to(acc)
    return y.to(x.dtype)


_DEFAULT = object()  # "the model's own setting" for per-call options
# A suspect dense attention kernel swapped in for a run (subjects/substitution.py PrefillAttention).
_ATTENTION: ContextVar["Callable[..., torch.Tensor] | None"] = ContextVar("llmdoctor_attention", default=None)
# (engine arithmetic, weights) of the run in progress when it emulates an engine (see Weights).
_EMULATING: ContextVar["tuple[EnginePrecision, Weights] | None"] = ContextVar("llmdoctor_emulating", default=None)
# Called as hook(x, w, y) with every product y = x w^T of `linear`, returns the y to use (a tensor-parallel
# rank all-reduces its row-parallel partial sums here: reference/tensor_parallel.py).
_PRODUCT_HOOK: ContextVar["Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None"] = ContextVar(
    "llmdoctor_product_hook", default=None)


@contextmanager
def product_hook(hook: "Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]") -> Iterator[None]:
    """Run `hook(x, w, y)` on every product of `linear` inside the block (before any bias is added)."""
    token = _PRODUCT_HOOK.set(hook)
    try:
        yield
    finally:
        _PRODUCT_HOOK.reset(token)


def engine_input(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] as the emulated engine feeds it to a product with the file's weight w (reducing over
    `in`): put through the activation round trip for w's GGML type when emulating an engine that
    quantizes activations (llama.cpp's CPU matmuls), else x itself."""
    em = _EMULATING.get()
    if em is not None and em[0].activation_quant:
        qtype = em[1].qtypes.get(w.data_ptr())
        if qtype is not None:
            return quantize_activations(x, qtype)
    return x


def emulating() -> bool:
    """Whether this forward pass emulates an engine's arithmetic (`forward(emulate=...)`)."""
    return _EMULATING.get() is not None


def kv_cache_dtype() -> torch.dtype | None:
    """The emulated engine's KV cache dtype (Q, K, V and P rounded to it around attention), or None."""
    em = _EMULATING.get()
    return em[0].kv_dtype if em is not None else None


def kv_cache_fp8() -> "KVCacheFP8 | None":
    """The emulated engine's fp8 KV cache (its per-layer k/v scales and rounding: reference/emulate.py
    `KVCacheFP8`), or None."""
    em = _EMULATING.get()
    return em[0].kv_fp8 if em is not None else None


def attention_rounding() -> "tuple[Callable, Callable] | None":
    """The emulated engine's rounding of attention's dot inputs, (of Q, K and V; of the weights P), TF32 in a
    float32 Triton kernel (reference/emulate.py `tf32`, `tf32_weights`), or None."""
    em = _EMULATING.get()
    mode = em[0].attention_tf32 if em is not None else None
    return None if mode is None else ((lambda t: tf32(t, mode)), (lambda p: tf32_weights(p, mode)))


def indexer_rounding() -> "Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None":
    """The emulated engine's rounding of a DSA indexer's (q, k) before their dot, or None: FP8 blocks (vLLM's
    CUDA indexer, reference/emulate.py `fp8_blocks`), q's scale floored at amax 1e-10
    (per_token_group_quant_fp8), k's at 1e-4 (indexer_k_quant_and_cache)."""
    em = _EMULATING.get()
    block = em[0].indexer_fp8 if em is not None else 0
    if not block:
        return None
    return lambda q, k: (fp8_blocks(q, block, eps=1e-10), fp8_blocks(k, block, eps=1e-4))


def engine_rows(x: torch.Tensor) -> torch.Tensor:
    """Embedding rows x [T, n_embd] (from `Weights.rows`) as the emulated engine dequantizes them."""
    em = _EMULATING.get()
    if em is None or not em[0].embedding_half:
        return x
    return half_dequant(x, em[1].qtypes.get(x.data_ptr()))


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] @ w[out, in]^T (+ b) -> [T, out], as the emulated engine computes the product
    (`EnginePrecision.product`: its activation rounding, its matmul kernel's arithmetic)."""
    em = _EMULATING.get()
    if em is None:
        y = x @ w.t()
    else:
        ptr = w.data_ptr()
        y = em[0].product(x, w, em[1].qtypes.get(ptr), getattr(em[1], "raws", {}).get(ptr))
    hook = _PRODUCT_HOOK.get()
    if hook is not None:
        y = hook(x, w, y)
    return y + b if b is not None else y


def ffn_act(name: str, gate: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(gate)
    if name == "gelu_tanh":
        return F.gelu(gate, approximate="tanh")
    raise InputError(f"unknown FFN activation {name!r}")


def rope_qk(st: Step, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [T, H, D] and k [T, Hk, D] with the layer's base (llama.cpp get_rope_freq_base:
    the SWA base on sliding-window layers) and the file's rope_freqs factors when present."""
    cfg = st.cfg
    ff = None if cfg.rope_freq_factors is None else torch.tensor(cfg.rope_freq_factors, dtype=torch.float64,
                                                                  device=st.positions.device)
    cos, sin = attn.rope_cos_sin(st.positions, cfg.rope_dim, cfg.layer_rope_base(st.il),
                                 pos_scale=cfg.rope_scale, freq_factors=ff)
    return (attn.apply_rope(q, cos, sin, neox=cfg.rope_neox),
            attn.apply_rope(k, cos, sin, neox=cfg.rope_neox))


def dense_attention(st: Step, h: torch.Tensor) -> torch.Tensor:
    """Self-attention of a llama-like layer on the normed input h [T, n_embd] -> [T, n_embd]."""
    cfg, T = st.cfg, h.shape[0]
    bias = (lambda kind: st.w(kind, "bias")) if cfg.qkv_bias else (lambda kind: None)
    q = linear(h, st.w(MODEL_TENSOR.ATTN_Q), bias(MODEL_TENSOR.ATTN_Q)).view(T, cfg.n_head, cfg.head_dim)
    k = linear(h, st.w(MODEL_TENSOR.ATTN_K), bias(MODEL_TENSOR.ATTN_K)).view(T, cfg.n_head_kv, cfg.head_dim)
    v = linear(h, st.w(MODEL_TENSOR.ATTN_V), bias(MODEL_TENSOR.ATTN_V)).view(T, cfg.n_head_kv, cfg.head_dim_v)
    if cfg.qk_norm:
        q = rms_norm(q, st.w(MODEL_TENSOR.ATTN_Q_NORM), cfg.norm_eps)
        k = rms_norm(k, st.w(MODEL_TENSOR.ATTN_K_NORM), cfg.norm_eps)
    q, k = rope_qk(st, q, k)
    st.cap("Qcur", q)
    st.cap("Kcur", k)
    st.cap("Vcur", v)
    kv_dtype = kv_cache_dtype()
    if kv_dtype is not None:  # the engine's KV cache (and the matmuls against it) in kv_dtype
        q, k, v = (t.to(kv_dtype).to(t.dtype) for t in (q, k, v))
    fp8 = kv_cache_fp8()
    if fp8 is not None:  # the engine's fp8 KV cache with its scales (and Q in fp8 where its backend takes one)
        q, k, v = fp8.q(st.il, q), fp8.k(st.il, k), fp8.v(st.il, v)
    dot_round = attention_rounding()
    if dot_round is not None:  # the engine's attention dots read Q, K, V (and P) rounded
        q, k, v = (dot_round[0](t) for t in (q, k, v))
    swapped = _ATTENTION.get()
    if swapped is not None:  # op substitution: a suspect attention kernel in place of ours
        o = swapped(q, k, v, scale=cfg.attn_scale, window=cfg.layer_window(st.il), softcap=cfg.attn_softcap)
    else:
        o = attn.attention(q, k, v, scale=cfg.attn_scale, window=cfg.layer_window(st.il), q_chunk=st.kv_chunk,
                           softcap=cfg.attn_softcap, kv_chunk=st.kv_chunk,
                           p_dtype=kv_dtype or (dot_round[1] if dot_round else None)
                           or (fp8.weights(st.il) if fp8 else None))  # [T, H, Dv]
    o = st.cap("kqv_out", o.reshape(T, cfg.n_head * cfg.head_dim_v))
    return st.cap("attn_out", linear(o, st.w(MODEL_TENSOR.ATTN_OUT)))


def dense_ffn(st: Step, h: torch.Tensor) -> torch.Tensor:
    """Gated FFN: down(act(gate(h)) * up(h)) (llama.cpp build_ffn with LLM_FFN_PAR)."""
    g = ffn_act(st.cfg.ffn_act, linear(h, st.w(MODEL_TENSOR.FFN_GATE)))
    return linear(g * linear(h, st.w(MODEL_TENSOR.FFN_UP)), st.w(MODEL_TENSOR.FFN_DOWN))


@register_block("llama", "qwen2", "qwen3", "gemma3")
def dense_block(st: Step, x: torch.Tensor) -> torch.Tensor:
    """Pre-norm block; gemma3 adds post-attention and post-FFW norms before each residual add
    (llama.cpp src/models/llama.cpp, qwen2.cpp, qwen3.cpp, gemma3.cpp)."""
    cfg, eps = st.cfg, st.cfg.norm_eps
    h = st.cap("attn_norm", rms_norm(x, st.w(MODEL_TENSOR.ATTN_NORM), eps))
    a = dense_attention(st, h)
    if cfg.post_norms:
        a = st.cap("attn_post_norm", rms_norm(a, st.w(MODEL_TENSOR.ATTN_POST_NORM), eps))
    x = st.cap("ffn_inp", x + a)
    h = st.cap("ffn_norm", rms_norm(x, st.w(MODEL_TENSOR.FFN_NORM), eps))
    f = st.cap("ffn_out", dense_ffn(st, h))
    if cfg.post_norms:
        f = st.cap("ffn_post_norm", rms_norm(f, st.w(MODEL_TENSOR.FFN_POST_NORM), eps))
    return st.cap("l_out", x + f)


# ---- the model ----------------------------------------------------------------------------------

class ReferenceModel:
    """A model run layer by layer from its mmap: a GGUF file, or an HF checkpoint directory (config.json
    + safetensors, read through gguf/layout.py's forward transforms: reference/checkpoint.py).
    `forward(ids, capture) -> (logits, captured)`.

    `vocab_chunk` rows of the output matrix are dequantized and multiplied at a time: 2048 rows of the
    demo's 640 columns (5 MB in float32) stay in cache between the dequantization and the matmul and
    reuse the allocator's memory, where 32768-row slices (84 MB) page-faulted fresh memory each time:
    the demo's output projection took 0.21 s with 32768 and 0.07 s with 2048 (an ad hoc timing while
    profiling bench_reference.py; the bench itself does not time the projection alone).
    """

    def __init__(self, path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 cache: bool = False, vocab_chunk: int = 2048, kv_chunk: int | None = 4096,
                 emulate: EnginePrecision | None = None, dequantizer: Callable[..., torch.Tensor] | None = None,
                 budget: DeviceBudget | None = None, capture_to: str | torch.device | None = None):
        if dtype not in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
            raise InputError(f"dtype {dtype} not supported (float64, float32, bfloat16, float16)")
        self.path = path
        self.dtype, self.device = dtype, torch.device(device)
        if Path(path).is_dir():  # an HF checkpoint: no GGUF (`g` is None), no dequantizer to swap
            if dequantizer is not None:
                raise InputError(f"{path}: a dequant kernel applies to GGUF weights, not to an HF checkpoint")
            if budget is not None and budget.cap is not None:
                raise InputError(f"{path}: --max-gpu-memory bounds a GGUF's dequantized weights, not an HF checkpoint's")
            self.g, self.source = None, Checkpoint(path)
            self.config = self.source.config
            self.weights = CheckpointWeights(self.source, dtype=dtype, device=self.device, cache=cache)
        else:
            self.g = self.source = open_gguf(path)
            self.config = from_gguf(self.g)
            if budget is not None:  # one layer must fit (reference/device_cache.py)
                budget.require(minimum_bytes(self.g, dtype.itemsize, vocab_chunk=vocab_chunk), f"{path} in {dtype}")
            self.weights = Weights(self.g, dtype=dtype, device=self.device, cache=cache, dequantizer=dequantizer,
                                   budget=budget)
        self.block = _BLOCKS.get(self.config.arch)
        if self.block is None:
            raise InputError(f"{path}: no reference block for architecture {self.config.arch!r}")
        self.emulate = emulate
        self.vocab_chunk, self.kv_chunk = vocab_chunk, kv_chunk
        # captures kept on another device as they are made (a GPU run under a memory cap keeps them on the CPU)
        self.capture_to = None if capture_to is None else torch.device(capture_to)
        self.stats: list[LayerStats] = []

    def close(self) -> None:
        self.weights._cached.clear()
        self.source.close()

    def __enter__(self) -> "ReferenceModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def output_name(self) -> str:
        out = tensor_name(MODEL_TENSOR.OUTPUT)
        return out if self.weights.has(out) else tensor_name(MODEL_TENSOR.TOKEN_EMBD)

    @torch.no_grad()  # not inference_mode: its tensors break in-place ops of dequant kernels run later
    def forward(self, token_ids, capture: Iterable[str] | None = None, *, all_logits: bool = True,
                emulate: "EnginePrecision | None | object" = _DEFAULT,
                attention: "Callable[..., torch.Tensor] | None" = None, extra: dict | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """logits [T, n_vocab] (or [1, n_vocab] for the last position with all_logits=False) in the
        run dtype, and {capture name: tensor}. Positions are 0..T-1 (one sequence). `emulate`
        (default: the model's) reproduces an engine's arithmetic for this run (reference/emulate.py);
        `attention` swaps a suspect dense attention kernel in for every layer (op substitution);
        `extra` seeds the per-run state blocks share (e.g. arch_deepseek.DSA_OVERRIDE)."""
        emulate = self.emulate if emulate is _DEFAULT else emulate
        token = _EMULATING.set((emulate, self.weights) if emulate is not None else None)
        swap = _ATTENTION.set(attention)
        try:
            return self._forward(token_ids, capture, all_logits, dict(extra or {}))
        finally:
            _ATTENTION.reset(swap)
            _EMULATING.reset(token)

    def _forward(self, token_ids, capture: Iterable[str] | None, all_logits: bool,
                 extra: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise InputError("empty token sequence")
        if int(ids.min()) < 0 or int(ids.max()) >= cfg.n_vocab:
            raise InputError(f"token id out of range [0, {cfg.n_vocab})")
        rec = Recorder(capture, to=self.capture_to)
        x = engine_rows(self.weights.rows(tensor_name(MODEL_TENSOR.TOKEN_EMBD), ids))  # [T, n_embd]
        if cfg.embed_scale != 1.0:
            x = x * cfg.embed_scale
            rec("inp_scaled", x)
        positions = torch.arange(ids.numel(), device=self.device)
        for il in range(cfg.n_layer - cfg.n_nextn):  # NextN/MTP blocks are not part of the forward pass
            st = Step(cfg, il, positions, self.weights, rec, self.kv_chunk, extra)
            x = self.block(st, x)
        if not all_logits:
            x = x[-1:]
        x = rms_norm(x, self.weights.get(tensor_name(MODEL_TENSOR.OUTPUT_NORM)), cfg.norm_eps)
        rec("result_norm", x, slot=cfg.n_layer)
        logits = torch.cat([linear(x, w) for w in self.weights.row_slices(self.output_name(), self.vocab_chunk)], -1)
        if cfg.final_softcap:
            logits = cfg.final_softcap * torch.tanh(logits / cfg.final_softcap)
        rec("result_output", logits, slot=cfg.n_layer)
        self.stats = [rec.stats[k] for k in sorted(rec.stats)]
        return logits, rec.captured


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probabilities in float64 (KL divergences and top-k of half-precision runs stay exact)."""
    return torch.log_softmax(logits.to(torch.float64), dim=-1)
