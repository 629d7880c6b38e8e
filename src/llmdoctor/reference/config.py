"""`ModelConfig`: one dataclass built from GGUF metadata or from an HF config.json, so the two diff.

Per-architecture parsing lives in two registries keyed by name: `register_gguf(arch)` (GGUF
`general.architecture`) and `register_hf(model_type)` (HF `config.json` `model_type`). Other modules
(MLA / MoE architectures) add parsers there and fill `mla` / `moe`; nothing here needs editing.

Conventions and where they come from:
- GGUF keys are gguf-py's `Keys` constants; defaults and per-architecture facts follow llama.cpp's
  `llama_model::load_hparams` (src/llama-model.cpp) and its rope-type table `llama_model_rope_type`.
- HF fields follow transformers' `*Config` classes (LlamaConfig, Qwen2Config, Qwen3Config,
  Gemma3TextConfig) in transformers 5.x, including `rope_parameters` (older `rope_theta` /
  `rope_scaling` are accepted too).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from gguf import Keys

from ..errors import InputError
from ..hf_config import read_hf_config, text_config

# gemma3's local (sliding-window) layers: every `pattern`-th layer is global. llama.cpp hardcodes
# `set_swa_pattern(6)` and a local rope base of 10000 (`rope_freq_base_train_swa`) for LLM_ARCH_GEMMA3;
# transformers' Gemma3TextConfig has the same defaults (`sliding_window_pattern`=6, local theta 1e4).
GEMMA3_SWA_PATTERN = 6
GEMMA3_ROPE_BASE_SWA = 10_000.0


@dataclass
class ModelConfig:
    """Everything the reference forward pass needs about a model's shape and conventions."""

    arch: str  # GGUF architecture name (llama, qwen2, qwen3, gemma3, deepseek2, glm-dsa, ...)
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head size (GGUF attention.key_length)
    head_dim_v: int  # value head size (GGUF attention.value_length)
    n_ff: int
    n_vocab: int
    norm_eps: float
    rope_base: float
    rope_dim: int  # rotated dims per head (GGUF rope.dimension_count)
    rope_neox: bool  # True: rotate halves (NEOX); False: rotate adjacent pairs (llama.cpp "NORM")
    attn_scale: float  # multiplies q.k
    rope_scale: float = 1.0  # linear position scaling: positions are multiplied by this (1/factor)
    rope_freq_factors: tuple[float, ...] | None = None  # theta_i / factor_i (GGUF rope_freqs; HF llama3)
    rope_base_swa: float | None = None  # rope base of sliding-window layers, when it differs
    sliding_window: int | None = None  # a query sees keys with q_pos - k_pos < sliding_window
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    attn_softcap: float | None = None  # scores -> c * tanh(scores / c)
    final_softcap: float | None = None  # logits -> c * tanh(logits / c)
    embed_scale: float = 1.0  # token embeddings are multiplied by this
    ffn_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation)
    qk_norm: bool = False  # RMSNorm over each q/k head before rope
    post_norms: bool = False  # RMSNorm after attention and after the FFN (gemma2/3)
    qkv_bias: bool = False
    tied_output: bool = False  # the output projection is the token embedding
    mla: object | None = None  # filled by MLA architectures (reference/mla.py)
    moe: object | None = None  # filled by MoE architectures
    source: str = field(default="", compare=False)  # "gguf" or "hf"
    # trailing NextN/MTP blocks stored after the main layers (GLM-4.5/GLM-5 GGUFs: block_count counts
    # them, `<arch>.nextn_predict_layers` says how many); the forward pass skips them, as llama.cpp's
    # graphs do (they only serve speculative decoding). Not compared: config.json counts them apart.
    n_nextn: int = field(default=0, compare=False)

    def diff(self, other: "ModelConfig") -> dict[str, tuple[Any, Any]]:
        """{field: (self's, other's)} for every compared field that differs (floats to 1e-6 rel)."""
        out = {}
        for f in dataclasses.fields(self):
            if not f.compare:
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if _close(a, b):
                continue
            if a != b:
                out[f.name] = (a, b)
        return out

    def layer_rope_base(self, il: int) -> float:
        if self.swa_layers and self.swa_layers[il] and self.rope_base_swa is not None:
            return self.rope_base_swa
        return self.rope_base

    def layer_window(self, il: int) -> int | None:
        return self.sliding_window if self.swa_layers and self.swa_layers[il] else None


def _close(a: Any, b: Any) -> bool:
    """Floats (and tuples of floats) equal to 1e-6 relative: a GGUF stores float32, HF float64."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return a == b


def llama3_freq_factors(dim: int, theta: float, factor: float, low_freq_factor: float,
                        high_freq_factor: float, original_context: int) -> tuple[float, ...]:
    """Per-frequency divisors of llama 3.1's rope scaling, as convert_hf_to_gguf.py writes them into
    `rope_freqs` (LlamaModel.generate_extra_tensors; transformers' `_compute_llama3_parameters`
    divides inv_freq the same way): long wavelengths / factor, short ones kept, a smooth ramp between."""
    low_wavelen, high_wavelen = original_context / low_freq_factor, original_context / high_freq_factor
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


GGUFParser = Callable[[Any], ModelConfig]  # (GGUFFile) -> ModelConfig
HFParser = Callable[[dict], ModelConfig]

_GGUF_PARSERS: dict[str, GGUFParser] = {}
_HF_PARSERS: dict[str, HFParser] = {}


def register_gguf(*archs: str) -> Callable[[GGUFParser], GGUFParser]:
    def deco(fn: GGUFParser) -> GGUFParser:
        for a in archs:
            _GGUF_PARSERS[a] = fn
        return fn

    return deco


def register_hf(*model_types: str) -> Callable[[HFParser], HFParser]:
    def deco(fn: HFParser) -> HFParser:
        for t in model_types:
            _HF_PARSERS[t] = fn
        return fn

    return deco


def _load_parsers() -> None:
    """Import the modules that register parsers for other architectures (when present)."""
    import importlib

    importlib.import_module("llmdoctor.reference.arch_deepseek")  # deepseek2, glm-dsa (parsers + block)


def from_gguf(g: Any) -> ModelConfig:
    """ModelConfig from an open GGUFFile's metadata (and tensor list, for tied output)."""
    _load_parsers()
    arch = g.get("general.architecture")
    parser = _GGUF_PARSERS.get(arch)
    if parser is None:
        raise InputError(f"{g.path}: architecture {arch!r} not supported (known: {', '.join(sorted(_GGUF_PARSERS))})")
    cfg = parser(g)
    cfg.n_nextn = int(g.get(f"{arch}.nextn_predict_layers") or 0)
    return cfg


def from_hf(config: dict | str | os.PathLike | Any) -> ModelConfig:
    """ModelConfig from an HF config: a config.json path (or its directory), its dict, or a
    transformers PretrainedConfig."""
    _load_parsers()
    if isinstance(config, (str, os.PathLike)):
        config = read_hf_config(config)
    d = text_config(config if isinstance(config, dict) else config.to_dict())
    parser = _HF_PARSERS.get(d.get("model_type"))
    if parser is None:
        raise InputError(f"HF model_type {d.get('model_type')!r} not supported (known: {', '.join(sorted(_HF_PARSERS))})")
    return parser(d)


# ---- GGUF -------------------------------------------------------------------------------------

def gguf_key(g: Any, key: str, arch: str, default: Any = ...) -> Any:
    """Metadata value of a gguf-py `Keys` template (`{arch}` filled in); InputError if required and absent."""
    name = key.format(arch=arch)
    v = g.get(name)
    if v is None:
        if default is ...:
            raise InputError(f"{g.path}: missing metadata key {name}")
        return default
    return v


def _has_tensor(g: Any, name: str) -> bool:
    return any(t.name == name for t in g.tensors)


def dense_from_gguf(g: Any, arch: str, **overrides: Any) -> ModelConfig:
    """The fields every llama-like architecture shares, read as llama.cpp's load_hparams reads them.

    head_dim defaults to n_embd / n_head (llama.cpp: n_embd_head_k), rope_dim to head_dim, and the
    vocab size to the token embedding's row count (the tokenizer list may be padded differently).
    Linear rope scaling: llama.cpp sets freq_scale = 1 / rope.scaling.factor.
    """
    n_embd = int(gguf_key(g, Keys.LLM.EMBEDDING_LENGTH, arch))
    n_head = int(gguf_key(g, Keys.Attention.HEAD_COUNT, arch))
    head_dim = int(gguf_key(g, Keys.Attention.KEY_LENGTH, arch, n_embd // n_head))
    scaling = gguf_key(g, Keys.Rope.SCALING_TYPE, arch, "none")
    factor = float(gguf_key(g, Keys.Rope.SCALING_FACTOR, arch, 0.0) or 0.0)
    if scaling not in ("none", "linear"):  # llama3-style factors come as the rope_freqs tensor, not here
        raise InputError(f"{g.path}: rope scaling {scaling!r} not supported for {arch}")
    n_layer = int(gguf_key(g, Keys.LLM.BLOCK_COUNT, arch))
    embd = g.tensor("token_embd.weight")
    cfg = dict(
        arch=arch,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(gguf_key(g, Keys.Attention.HEAD_COUNT_KV, arch, n_head)),
        head_dim=head_dim,
        head_dim_v=int(gguf_key(g, Keys.Attention.VALUE_LENGTH, arch, head_dim)),
        n_ff=int(gguf_key(g, Keys.LLM.FEED_FORWARD_LENGTH, arch, 0)),
        n_vocab=int(embd.ne[1]),
        norm_eps=float(gguf_key(g, Keys.Attention.LAYERNORM_RMS_EPS, arch)),
        rope_base=float(gguf_key(g, Keys.Rope.FREQ_BASE, arch, 10_000.0)),
        rope_dim=int(gguf_key(g, Keys.Rope.DIMENSION_COUNT, arch, head_dim)),
        rope_neox=True,
        rope_scale=1.0 / factor if scaling == "linear" and factor else 1.0,
        attn_scale=1.0 / math.sqrt(head_dim),
        attn_softcap=_opt_float(gguf_key(g, Keys.LLM.ATTN_LOGIT_SOFTCAPPING, arch, None)),
        final_softcap=_opt_float(gguf_key(g, Keys.LLM.FINAL_LOGIT_SOFTCAPPING, arch, None)),
        rope_freq_factors=_rope_freqs(g),
        qkv_bias=_has_tensor(g, "blk.0.attn_q.bias"),  # llama.cpp loads q/k/v biases when present
        tied_output=not _has_tensor(g, "output.weight"),
        source="gguf",
    )
    cfg.update(overrides)
    return ModelConfig(**cfg)


def _rope_freqs(g: Any) -> tuple[float, ...] | None:
    """The `rope_freqs` tensor (F32, one divisor per rotated pair) that llama.cpp passes to every
    ggml_rope_ext as freq_factors, when the file has one."""
    if not _has_tensor(g, "rope_freqs.weight"):
        return None
    return tuple(float(x) for x in g.tensor("rope_freqs.weight").numpy().reshape(-1))


def _opt_float(v: Any) -> float | None:
    return float(v) if v else None


@register_gguf("llama")
def _llama_gguf(g: Any) -> ModelConfig:
    """llama (and mistral files, which llama.cpp loads as llama): rope type NORM, i.e. adjacent pairs,
    because convert_hf_to_gguf.py permutes the Q/K rows of HF's rotate-half layout."""
    return dense_from_gguf(g, "llama", rope_neox=False)


@register_gguf("qwen2")
def _qwen2_gguf(g: Any) -> ModelConfig:
    """qwen2: NEOX rope, q/k/v biases (llama.cpp build_qwen2)."""
    return dense_from_gguf(g, "qwen2", qkv_bias=True)


@register_gguf("qwen3")
def _qwen3_gguf(g: Any) -> ModelConfig:
    """qwen3: NEOX rope, per-head q/k RMSNorm before rope, no biases (llama.cpp build_qwen3)."""
    return dense_from_gguf(g, "qwen3", qk_norm=True)


@register_gguf("gemma3")
def _gemma3_gguf(g: Any) -> ModelConfig:
    """gemma3 as llama.cpp loads it (load_hparams LLM_ARCH_GEMMA3, src/models/gemma3.cpp):
    embeddings x sqrt(n_embd); sliding window on every layer but each 6th (or the file's
    sliding_window_pattern); local layers use rope base 10000; attention scale 1/sqrt(key_length)
    (gemma_pytorch's query_pre_attn_scalar = head_dim for every size but 27B, where it is
    n_embd / n_head); GELU-tanh gated FFN; post-attention and post-FFW norms; the (1 + w) norm offset
    is already folded into the stored weights by convert_hf_to_gguf.py."""
    arch = "gemma3"
    n_layer = int(gguf_key(g, Keys.LLM.BLOCK_COUNT, arch))
    pattern = gguf_key(g, Keys.Attention.SLIDING_WINDOW_PATTERN, arch, GEMMA3_SWA_PATTERN)
    if hasattr(pattern, "__len__"):  # a per-layer bool array (newer converters)
        swa = tuple(bool(x) for x in pattern)
    else:
        swa = tuple(bool((i + 1) % int(pattern)) for i in range(n_layer))
    n_embd = int(gguf_key(g, Keys.LLM.EMBEDDING_LENGTH, arch))
    n_head = int(gguf_key(g, Keys.Attention.HEAD_COUNT, arch))
    head_dim = int(gguf_key(g, Keys.Attention.KEY_LENGTH, arch, n_embd // n_head))
    scale_dim = n_embd // n_head if n_layer == 62 else head_dim  # 62 layers = llama.cpp's LLM_TYPE_27B
    return dense_from_gguf(
        g, arch,
        rope_base_swa=float(gguf_key(g, Keys.Rope.FREQ_BASE_SWA, arch, GEMMA3_ROPE_BASE_SWA)),
        sliding_window=int(gguf_key(g, Keys.Attention.SLIDING_WINDOW, arch)),
        swa_layers=swa,
        attn_scale=1.0 / math.sqrt(scale_dim),
        embed_scale=math.sqrt(n_embd),
        ffn_act="gelu_tanh",
        qk_norm=True,
        post_norms=True,
    )


# ---- HF config.json ---------------------------------------------------------------------------

def _hf_rope_params(d: dict, layer_type: str | None = None) -> dict:
    """One rope parameter dict from transformers 5 `rope_parameters` or the older `rope_theta` /
    `rope_scaling` fields (keys: rope_theta, rope_type, factor, ...)."""
    params = d.get("rope_parameters") or {}
    if layer_type and layer_type in params:
        params = params[layer_type]
    elif params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention", {})
    out = dict(d.get("rope_scaling") or {})
    out.setdefault("rope_type", out.pop("type", "default"))
    out["rope_theta"] = d.get("rope_theta", 10_000.0)
    out.update(params)
    return out


def _hf_rope(d: dict, layer_type: str | None = None) -> tuple[float, float, str]:
    """(theta, linear position scale, rope_type) of `_hf_rope_params`."""
    p = _hf_rope_params(d, layer_type)
    rtype = p.get("rope_type") or "default"
    return float(p["rope_theta"]), (1.0 / float(p.get("factor") or 1.0) if rtype == "linear" else 1.0), rtype


def dense_from_hf(d: dict, arch: str, **overrides: Any) -> ModelConfig:
    """Shared llama-like fields from an HF config dict (transformers' LlamaConfig field names)."""
    n_embd = int(d["hidden_size"])
    n_head = int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or n_embd // n_head)
    theta, rope_scale, rtype = _hf_rope(d)
    if rtype not in ("default", "linear", "llama3"):
        raise InputError(f"HF rope type {rtype!r} not supported for {arch}")
    prf = float(d.get("partial_rotary_factor", 1.0) or 1.0)
    freq_factors = None
    if rtype == "llama3":
        p = _hf_rope_params(d)
        freq_factors = llama3_freq_factors(int(head_dim * prf), theta, float(p["factor"]), float(p["low_freq_factor"]),
                                           float(p["high_freq_factor"]), int(p["original_max_position_embeddings"]))
    cfg = dict(
        arch=arch,
        n_layer=int(d["num_hidden_layers"]),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(d.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        head_dim_v=head_dim,
        n_ff=int(d["intermediate_size"]),
        n_vocab=int(d["vocab_size"]),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_base=theta,
        rope_dim=int(head_dim * prf),
        rope_neox=True,
        rope_scale=rope_scale,
        rope_freq_factors=freq_factors,
        attn_scale=1.0 / math.sqrt(head_dim),
        tied_output=bool(d.get("tie_word_embeddings", False)),
        source="hf",
    )
    cfg.update(overrides)
    return ModelConfig(**cfg)


@register_hf("llama", "mistral")
def _llama_hf(d: dict) -> ModelConfig:
    """HF llama/mistral: HF rotates halves, but the GGUF stores Q/K permuted for adjacent-pair rope;
    the config describes the GGUF view (rope_neox=False) so both sides diff equal. Mistral's
    sliding_window is ignored, as llama.cpp's llama graph ignores it."""
    return dense_from_hf(d, "llama", rope_neox=False, qkv_bias=bool(d.get("attention_bias", False)))


@register_hf("qwen2")
def _qwen2_hf(d: dict) -> ModelConfig:
    return dense_from_hf(d, "qwen2", qkv_bias=True)


@register_hf("qwen3")
def _qwen3_hf(d: dict) -> ModelConfig:
    return dense_from_hf(d, "qwen3", qk_norm=True)


@register_hf("gemma3_text", "gemma3")
def _gemma3_hf(d: dict) -> ModelConfig:
    """transformers Gemma3TextConfig: layer_types (or sliding_window_pattern), per-layer-type
    rope_parameters, attention scale query_pre_attn_scalar**-0.5, embedding scale sqrt(hidden)."""
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types") or [
        "sliding_attention" if (i + 1) % int(d.get("sliding_window_pattern", GEMMA3_SWA_PATTERN)) else "full_attention"
        for i in range(n)
    ]
    theta_local, _, _ = _hf_rope(d, "sliding_attention")
    if "rope_parameters" not in d:
        theta_local = float(d.get("rope_local_base_freq", GEMMA3_ROPE_BASE_SWA))
    softcap = d.get("final_logit_softcapping")
    return dense_from_hf(
        d, "gemma3",
        rope_base_swa=theta_local,
        sliding_window=int(d.get("sliding_window") or 4096),
        swa_layers=tuple(t == "sliding_attention" for t in types),
        attn_scale=float(d.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=_opt_float(d.get("attn_logit_softcapping")),
        final_softcap=_opt_float(softcap),
        embed_scale=math.sqrt(int(d["hidden_size"])),
        ffn_act="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        tied_output=bool(d.get("tie_word_embeddings", True)),
    )
