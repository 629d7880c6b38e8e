"""`check mapping`: do a GGUF file and an HF model describe the same network?

The two sides:
- GGUF: tensor names, shapes, quant types, metadata (`ModelConfig` via reference/config.py).
- HF: the parameter list and shapes of transformers' model built from config.json on the meta device
  (per-expert checkpoint names through `layout.checkpoint_names/_shapes`); when transformers does not
  know the model type, the checkpoint's own tensor list (safetensors headers). With `--hf DIR` the
  checkpoint tensors themselves (safetensors library) for the numeric check. Without any HF config the
  HF side is the GGUF's own metadata written as a config.json (`hf_config`): names and shapes are then
  checked against what the metadata implies, and metadata semantics are skipped (nothing to compare).
  NextN/MTP blocks that GLM GGUFs count in block_count (transformers builds no module for them) come
  from the checkpoint when given, else are listed as such.

Every transform is `gguf/layout.py`'s `plan` (forward: what convert_hf_to_gguf.py does; inverse: back).

Findings (check="mapping"), by `target` prefix:
  names/...     both directions: HF parameters with no GGUF source (legitimately derived ones listed
                with the reason, e.g. a tied lm_head), GGUF tensors with no HF parameter
  collision/... two HF tensors mapped onto one GGUF name
  shape/...     the GGUF tensor vs the HF shape taken through the forward transform (on meta tensors)
  type/...      quant types an engine cannot consume (quantized DSA indexer or 1-D tensors)
  metadata/...  `ModelConfig.diff` of the two sides plus BOS/EOS ids, each with both values
  numeric/...   with --hf DIR: dequantized GGUF tensor, inverse transform, vs the safetensors tensor
  engine/vllm   vLLM's own GGUF name map (the vllm-gguf-plugin's, asked in the `python` on PATH that
                imports vllm) diffed against ours; skipped with the reason where it cannot be asked

Numeric band (derivation). The GGUF tensor carries the error of its quantization and nothing else: the
transforms are permutations, reshapes, stacking (exact) and gemma's +1 (one float32 rounding). So the
expected relative L2 error is that of quantizing the HF tensor itself: e_q = rel_l2 of gguf-py's
quantize -> dequantize round trip of the forward-transformed HF tensor (llama.cpp's reference
quantizers, ported bit-exact), for the types gguf-py can quantize (F16, BF16, Q4_0 .. Q8_0, MXFP4).
For the K- and IQ-quants gguf-py cannot quantize, e_q = e_q(Q4_0) * 2**(bpw(Q4_0) - bpw(T)) with bpw
the type's bits per weight from GGML_QUANT_SIZES: one bit fewer doubles a uniform quantizer's step
(and K/IQ quants, with their scale search and finer scales, do at least as well as Q4_0 at equal bpw,
so this is an upper estimate: llama.cpp's own Q2_K..Q6_K and IQ4_XS land at 0.76-0.95 of it on random
weights, tests/checks/layout/test_check_mapping.py). The band is BAND_K * e_q + the transform's own rounding (gemma's
stored w + 1 in float32 undone: 2**-24 * ||1 + w|| / ||w||) + FLOAT32_FLOOR; BAND_K = 2 leaves room
for importance-matrix weighting, which trades unweighted error for weighted error. Cosine must be at
least sqrt(1 - band**2) (the smallest cosine of want + e with ||e|| = band * ||want||) less gamma_n(2^-53),
the float64 evaluation error of an n-element cosine (Higham Lemma 3.1). A tensor holding
another tensor's values (swap, wrong permutation) has rel_l2 near sqrt(2) and cosine near 0, outside
the band of every type of at least 2.5 bits per weight (band <= 0.75 for Gaussian-like weights, where
e_q(Q4_0) is about 0.1).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf import quants

from ...errors import EngineError, EngineUnavailable, InputError
from ...hf_config import config_path, read_hf_config, text_config
from ...reference.config_hf import hf_config, main_layers, nextn_layers
from ...gguf import layout, open_gguf
from ...reference.checkpoint import SafetensorsDir
from ...reference.config import ModelConfig, from_gguf, from_hf
from .. import metrics as M
from ..base import Finding

CHECK = "mapping"
BAND_K = 2.0
FLOAT32_FLOOR = 2.0**-24
SAMPLE_ELEMENTS = 1 << 24  # a "copy" tensor larger than this is compared on SAMPLE_ROWS evenly spaced rows
SAMPLE_ROWS = 4096
BAND_ELEMENTS = 1 << 16  # elements of the HF tensor quantized to estimate its round-trip error
UNQUANTIZED = (QT.F32, QT.F16, QT.BF16, QT.F64)
# GGUF tensors the converter derives from config.json rather than from an HF parameter
# (LlamaModel.generate_extra_tensors: llama3 rope factors; Phi3: long/short factors).
DERIVED_GGUF = re.compile(r"^(rope_freqs|rope_factors_long|rope_factors_short)\.weight$")


def _finding(target: str, status: str, explanation: str = "", **kw: Any) -> Finding:
    subject = kw.pop("subject", "gguf<->hf")
    return Finding(CHECK, subject, target, status, explanation=explanation, **kw)


# ---- the HF side -----------------------------------------------------------------------------------

@dataclass
class HFSide:
    config: dict  # config.json (the text config of a multimodal wrapper)
    shapes: dict[str, tuple[int, ...]]  # checkpoint name -> torch shape
    source: str  # where names and shapes came from
    from_gguf: bool = False  # the config was written from the GGUF's own metadata
    checkpoint: Path | None = None  # the --hf directory
    tensors: SafetensorsDir | None = field(default=None, repr=False)  # its safetensors (reference/checkpoint.py)

    @property
    def files(self) -> dict[str, Path]:
        """Checkpoint name -> safetensors file ({} without a checkpoint)."""
        return self.tensors.files if self.tensors is not None else {}

    def tensor(self, name: str, rows: torch.Tensor | None = None) -> torch.Tensor | None:
        """The checkpoint tensor (only `rows` of it when given), or None when absent."""
        if name not in self.files:
            return None
        return self.tensors.tensor(name) if rows is None else self.tensors.rows(name, [int(i) for i in rows])


def config_object(config: dict) -> Any:
    """transformers' PretrainedConfig for a config.json dict, or None when it does not know the type."""
    from transformers import CONFIG_MAPPING

    if config.get("model_type") not in CONFIG_MAPPING:  # a lazy mapping: `in`, not `.get`
        return None
    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(
            {k: v for k, v in config.items() if k != "transformers_version"})
    except Exception as e:  # TypeError/ValueError/KeyError and huggingface_hub's validation errors
        raise InputError(f"transformers rejects this {config['model_type']} config: {e}") from None


def meta_shapes(config: dict) -> dict[str, tuple[int, ...]] | None:
    """Checkpoint names and shapes of transformers' model for `config` on the meta device, or None
    when transformers does not know the model type."""
    import transformers

    cfg = config_object(config)
    if cfg is None:
        return None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # TypeError/ValueError/KeyError and huggingface_hub's validation errors
        raise InputError(f"transformers cannot build a {config['model_type']} model from this config: {e}") from None
    runtime = {n: tuple(t.shape) for n, t in model.state_dict().items() if not n.endswith("inv_freq")}
    return layout.checkpoint_shapes(runtime, int(config.get("n_routed_experts") or config.get("num_experts") or 0))


def load_hf(hf: Path | None, g: Any, cfg: ModelConfig) -> HFSide:
    """The HF side from a checkpoint directory, a config.json, or (None) the GGUF's own metadata."""
    tensors = None
    if hf is None:
        config, origin = hf_config(cfg, g), "the GGUF's own metadata written as a config.json"
    else:
        path = Path(hf)
        config, origin = read_hf_config(path), str(config_path(path))
        if path.is_dir():
            tensors = SafetensorsDir(path)
    files = tensors.files if tensors is not None else {}
    config = text_config(config)
    shapes = meta_shapes(config)
    source = f"transformers (meta device) from {origin}"
    if shapes is None:
        if not files:
            raise InputError(f"transformers does not know model_type {config.get('model_type')!r} and no "
                             "safetensors checkpoint was given: no HF parameter list")
        shapes, source = _checkpoint_shapes(tensors, files), f"the checkpoint's tensor list ({path})"
    else:  # NextN/MTP layers past num_hidden_layers: in the checkpoint, but transformers builds no module
        n = int(config.get("num_hidden_layers") or 0)
        shapes.update(_checkpoint_shapes(tensors, [k for k in files if (b := _layer(k)) is not None and b >= n]))
    return HFSide(config, shapes, source, from_gguf=hf is None,
                  checkpoint=Path(hf) if hf is not None and Path(hf).is_dir() else None, tensors=tensors)


def _checkpoint_shapes(tensors: SafetensorsDir | None, names: Any) -> dict[str, tuple[int, ...]]:
    return {name: tensors.shape(name) for name in names}


def _layer(name: str) -> int | None:
    """The block index of an HF (model.layers.N.) or GGUF (blk.N.) tensor name."""
    m = re.match(r"(?:model\.layers|blk)\.(\d+)\.", name)
    return int(m[1]) if m else None


# ---- names, collisions, shapes, types ----------------------------------------------------------------

def _names(p: layout.Plan, hf: HFSide, gg: dict[str, Any]) -> list[Finding]:
    out = []
    n_main = int(hf.config.get("num_hidden_layers") or 0)
    mtp = {n: "NextN/MTP block: transformers builds no module for it (give the checkpoint, --hf DIR, to compare it)"
           for n in gg if hf.config.get("num_nextn_predict_layers") and (_layer(n) or 0) >= n_main}
    for name in p.unmapped:
        out.append(_finding(f"names/{name}", "fail", f"HF parameter {name} has no GGUF name for {p.arch} "
                            "(gguf-py's TensorNameMap knows none)", evidence=[{"hf": name}]))
    targets = p.by_target()
    for r in p.rules:
        missing = [t for t in r.targets if t not in gg]
        if missing:
            out.append(_finding(f"names/{r.sources[0]}", "fail",
                                f"HF parameter {_srcs(r)} has no GGUF source: {', '.join(missing)} is not in the file",
                                evidence=[{"hf": list(r.sources[:4]), "gguf_missing": missing}]))
    for name in gg:
        if name not in targets and not DERIVED_GGUF.match(name) and name not in mtp:
            out.append(_finding(f"names/{name}", "fail", f"GGUF tensor {name} has no HF parameter in {hf.source}",
                                evidence=[{"gguf": name}]))
    derived = {**p.skipped, **{n: "derived by the converter from config.json" for n in gg if DERIVED_GGUF.match(n)},
               **{n: why for n, why in mtp.items() if n not in targets}}
    listed = "derived, not stored: " + ("; ".join(f"{k} ({v})" for k, v in list(derived.items())[:3]) or "none")
    evidence = [{"derived": k, "why": v} for k, v in derived.items()]
    if not out:
        out.append(_finding("names", "pass", f"{len(targets)} GGUF tensors <-> {sum(len(r.sources) for r in p.rules)} "
                            f"HF parameters, both directions; {listed}",
                            metrics={"gguf_tensors": len(gg), "hf_parameters": len(hf.shapes)}, evidence=evidence))
    elif derived:  # the legitimate absences, said even when others are wrong
        out.append(_finding("names/derived", "pass", listed, evidence=evidence))
    return out


def _srcs(r: layout.Rule) -> str:
    return r.sources[0] if len(r.sources) == 1 else f"{r.sources[0]} (+{len(r.sources) - 1} more)"


def _collisions(p: layout.Plan) -> list[Finding]:
    seen: dict[str, list[layout.Rule]] = {}
    for r in p.rules:
        for t in r.targets:
            seen.setdefault(t, []).append(r)
    bad = {t: [s for r in rs for s in r.sources] for t, rs in seen.items() if len(rs) > 1}
    if not bad:
        return [_finding("collisions", "pass", f"no two HF tensors map onto one GGUF name ({len(seen)} names)")]
    return [_finding(f"collision/{t}", "fail", f"{' and '.join(s[:3])} all map onto {t}", evidence=[{"gguf": t, "hf": s}])
            for t, s in bad.items()]


def _expected_shapes(r: layout.Rule, hf: HFSide) -> list[tuple[int, ...]]:
    """GGUF shapes (torch order) the forward transform makes of the HF shapes (run on meta tensors)."""
    xs = [torch.empty(hf.shapes[s], device="meta") for s in r.sources]
    return [tuple(t.shape) for t in r.forward(xs)]


def _shapes(p: layout.Plan, hf: HFSide, gg: dict[str, Any]) -> list[Finding]:
    out, n = [], 0
    for r in p.rules:
        if any(t not in gg for t in r.targets) or any(s not in hf.shapes for s in r.sources):
            continue
        try:
            want = _expected_shapes(r, hf)
        except RuntimeError as e:
            out.append(_finding(f"shape/{r.targets[0]}", "fail", f"{_srcs(r)} {hf.shapes[r.sources[0]]} cannot go "
                                f"through {r.transform} with this config: {e}"))
            continue
        for t, w in zip(r.targets, want):
            n += 1
            got = gg[t].shape
            if got == w:
                continue
            why = ""
            if len(got) >= 2 and got[:-2] + (got[-1], got[-2]) == w:
                why = (f": its last two dims are exchanged ({t} stored without the transpose {r.transform} makes)"
                       if r.transform == "kv_b_split" else ": it is stored transposed")
            out.append(_finding(f"shape/{t}", "fail",
                                f"{t} has shape {list(got)}; {_srcs(r)} {list(hf.shapes[r.sources[0]])} gives "
                                f"{list(w)} through {r.transform}{why}",
                                evidence=[{"gguf": t, "shape": list(got), "expected": list(w), "transform": r.transform}]))
    if not out:
        out.append(_finding("shapes", "pass", f"{n} GGUF tensors have the shapes the HF parameters take through "
                            "the converter's transforms"))
    return out


def _types(gg: dict[str, Any], consumer: str | None = None, quantized_indexer: bool = False) -> list[Finding]:
    """Tensor types engines consume. `consumer`: the engine that loads the file; one measured to consume a
    quantized DSA indexer (`quantized_indexer`, its trait: llama.cpp runs Q8_0 / Q4_0 indexer weights and
    agrees with the reference, tests/checks/compute/test_moe_routing.py; the transformers engine dequantizes every
    tensor) passes it."""
    indexer_ok = consumer is not None and quantized_indexer
    out = []
    for name, t in gg.items():
        if t.type in UNQUANTIZED:
            continue
        if ".indexer." in name and indexer_ok:
            out.append(_finding(f"type/{name}", "pass", f"{name} is {t.type.name}: {consumer} consumes a quantized "
                                "DSA indexer (vLLM's GGUF loader does not: keep indexer tensors F16/F32 for it)"))
        elif ".indexer." in name:
            out.append(_finding(f"type/{name}", "fail",
                                f"{name} is {t.type.name}: engines load the DSA indexer's weights unquantized (the "
                                "seed's vLLM loader raised KeyError on them). Fix: dequantize it to F16/F32 at load, "
                                "or keep indexer tensors F16/F32 when quantizing",
                                evidence=[{"gguf": name, "type": t.type.name}]))
        elif len(t.ne) == 1 or (len(t.ne) > 1 and all(d == 1 for d in t.ne[1:])):
            out.append(_finding(f"type/{name}", "fail",
                                f"{name} is a 1-D tensor stored {t.type.name}: norms and biases are consumed as F32 "
                                "(the converter keeps every 1-D tensor F32). Fix: dequantize it to F32 at load",
                                evidence=[{"gguf": name, "type": t.type.name}]))
    if not out:
        types = sorted({t.type.name for t in gg.values()})
        out.append(_finding("types", "pass", f"every tensor's type is one engines consume ({', '.join(types)}); "
                            "indexer and 1-D tensors unquantized"))
    return out


# ---- metadata semantics ------------------------------------------------------------------------------

# ModelConfig field -> (GGUF key, config.json key), for the messages.
KEYS = {
    "n_layer": ("block_count", "num_hidden_layers"), "n_embd": ("embedding_length", "hidden_size"),
    "n_head": ("attention.head_count", "num_attention_heads"),
    "n_head_kv": ("attention.head_count_kv", "num_key_value_heads"),
    "head_dim": ("attention.key_length", "head_dim"), "head_dim_v": ("attention.value_length", "head_dim"),
    "n_ff": ("feed_forward_length", "intermediate_size"), "n_vocab": ("token_embd rows", "vocab_size"),
    "norm_eps": ("attention.layer_norm_rms_epsilon", "rms_norm_eps"), "rope_base": ("rope.freq_base", "rope_theta"),
    "rope_dim": ("rope.dimension_count", "head_dim * partial_rotary_factor"),
    "rope_scale": ("rope.scaling.factor", "rope_parameters.factor"),
    "rope_base_swa": ("rope.freq_base_swa", "rope_parameters.sliding_attention.rope_theta"),
    "sliding_window": ("attention.sliding_window", "sliding_window"), "tied_output": ("no output.weight", "tie_word_embeddings"),
    "mla.kv_lora_rank": ("attention.kv_lora_rank", "kv_lora_rank"), "mla.q_lora_rank": ("attention.q_lora_rank", "q_lora_rank"),
    "mla.qk_nope": ("attention.key_length_mla - rope.dimension_count", "qk_nope_head_dim"),
    "mla.qk_rope": ("rope.dimension_count", "qk_rope_head_dim"), "mla.v_dim": ("attention.value_length_mla", "v_head_dim"),
    "mla.yarn.factor": ("rope.scaling.factor", "rope_parameters.factor"),
    "mla.yarn.mscale_all_dim": ("rope.scaling.yarn_log_multiplier / 0.1", "rope_parameters.mscale_all_dim"),
    "mla.indexer.n_head": ("attention.indexer.head_count", "index_n_heads"),
    "mla.indexer.head_dim": ("attention.indexer.key_length", "index_head_dim"),
    "mla.indexer.top_k": ("attention.indexer.top_k", "index_topk"),
    "moe.n_expert": ("expert_count", "n_routed_experts"), "moe.n_used": ("expert_used_count", "num_experts_per_tok"),
    "moe.n_shared": ("expert_shared_count", "n_shared_experts"), "moe.gating": ("expert_gating_func", "scoring_func"),
    "moe.scale": ("expert_weights_scale", "routed_scaling_factor"),
    "moe.n_dense_lead": ("leading_dense_block_count", "first_k_dense_replace"),
    "moe.norm_topk": ("expert_weights_norm", "norm_topk_prob"),
}


def _flat_diff(a: Any, b: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Field-by-field differences, descending into dataclasses (mla, moe, yarn, indexer)."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        out: dict[str, tuple[Any, Any]] = {}
        for f in dataclasses.fields(a):
            if f.compare:
                out.update(_flat_diff(getattr(a, f.name), getattr(b, f.name), f"{prefix}{f.name}."))
        return out
    if isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-6):
        return {}
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
            isinstance(x, float) and isinstance(y, float) and math.isclose(x, y, rel_tol=1e-6) or x == y
            for x, y in zip(a, b)):  # per-layer / per-frequency values, the GGUF's in float32
        return {}
    return {} if a == b else {prefix.rstrip("."): (a, b)}


def _metadata(cfg: ModelConfig, g: Any, hf: HFSide) -> list[Finding]:
    if hf.from_gguf:
        return [_finding("metadata", "skip", reason="no HF config.json given (--hf): metadata semantics need one")]
    try:
        other = from_hf(hf.config)
    except InputError as e:
        return [_finding("metadata", "skip", reason=f"config.json not parsed: {e}")]
    diffs: dict[str, tuple[Any, Any]] = {}
    for name, (a, b) in main_layers(cfg, nextn_layers(g, cfg.arch)).diff(other).items():
        diffs.update(_flat_diff(a, b, f"{name}."))
    for kind in ("bos", "eos"):
        got, want = g.get(f"tokenizer.ggml.{kind}_token_id"), hf.config.get(f"{kind}_token_id")
        if got is not None and want is not None and got not in (want if isinstance(want, list) else [want]):
            diffs[f"{kind}_token_id"] = (got, want)
    out = []
    for name, (a, b) in diffs.items():
        gk, hk = KEYS.get(name, (name, name))
        out.append(_finding(f"metadata/{name}", "fail", f"{name}: GGUF {cfg.arch}.{gk} = {_short(a)}, "
                            f"config.json {hk} = {_short(b)}", evidence=[{"field": name, "gguf": _short(a), "hf": _short(b)}]))
    if not out:
        out.append(_finding("metadata", "pass", "the GGUF metadata and config.json describe the same "
                            f"{cfg.arch} ({cfg.n_layer} layers, {cfg.n_head}/{cfg.n_head_kv} heads, rope base "
                            f"{cfg.rope_base:g}, vocab {cfg.n_vocab})"))
    return out


def _short(v: Any) -> Any:
    if isinstance(v, float) and float(np.float32(v)) == v:  # a GGUF float32: its shortest float32 spelling
        return float(str(np.float32(v)))
    if isinstance(v, (tuple, list)) and len(v) > 8:
        return f"{list(v[:8])}... ({len(v)})"
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


# ---- numeric -----------------------------------------------------------------------------------------

def _bpw(t: QT) -> float:
    bs, ts = GGML_QUANT_SIZES[t]
    return 8.0 * ts / bs


def _roundtrip(x: torch.Tensor, qtype: QT) -> torch.Tensor:
    """gguf-py quantize -> dequantize of x [..., ne0] (float32)."""
    a = x.detach().to(torch.float32).cpu().numpy().reshape(-1, x.shape[-1])
    return torch.from_numpy(quants.dequantize(quants.quantize(a, qtype), qtype).reshape(x.shape))


def quant_error(x: torch.Tensor, qtype: QT) -> tuple[float, str]:
    """(expected rel_l2 of storing x as qtype, how it was derived): see the module docstring."""
    if qtype in (QT.F32, QT.F64):
        return 0.0, "exact"
    if x.shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return math.nan, "row not a whole number of blocks"
    try:
        return M.rel_l2(_roundtrip(x, qtype), x), f"gguf-py {qtype.name} round trip"
    except NotImplementedError:
        pass
    if x.shape[-1] % GGML_QUANT_SIZES[QT.Q4_0][0]:
        return math.nan, f"no gguf-py quantizer for {qtype.name}"
    e4 = M.rel_l2(_roundtrip(x, QT.Q4_0), x)
    return e4 * 2.0 ** (_bpw(QT.Q4_0) - _bpw(qtype)), f"Q4_0 round trip x 2^({_bpw(QT.Q4_0):.3g} - {_bpw(qtype):.3g} bpw)"


def _rows(t: Any) -> torch.Tensor | None:
    """Indices of the rows compared for a large 2-D tensor, or None for all."""
    if t.n_elements <= SAMPLE_ELEMENTS or len(t.shape) != 2:
        return None
    return torch.linspace(0, t.shape[0] - 1, SAMPLE_ROWS).round().long().unique()


def _dequant(t: Any, rows: torch.Tensor | None = None) -> torch.Tensor:
    from ...gguf import dequantize

    if rows is None:
        return dequantize(t.data, t.type, t.shape, device="cpu")
    raw = t.data.reshape(t.shape[0], -1)[rows.numpy()]  # [n, row_bytes]
    return dequantize(np.ascontiguousarray(raw).reshape(-1), t.type, (len(rows), t.shape[1]), device="cpu")


@dataclass
class _Pair:
    rule: layout.Rule
    gg: list[torch.Tensor]  # dequantized GGUF targets (torch shapes)
    hf: list[torch.Tensor]  # HF sources, float32
    rows: torch.Tensor | None


def band(fwd: list[torch.Tensor], gg_types: list[QT], hf: list[torch.Tensor], transform: str
         ) -> tuple[float, dict[str, Any]]:
    """The error band of GGUF tensors `fwd` (the HF tensors `hf` taken through `transform`) stored as
    `gg_types`: BAND_K * e_q + transform rounding + FLOAT32_FLOOR (module docstring)."""
    eqs, how = [], set()
    for x, qt in zip(fwd, gg_types):
        if x.ndim >= 2:  # the error is a per-block statistic: every k-th row, about BAND_ELEMENTS in all
            x = x.reshape(-1, x.shape[-1])[:: max(1, math.ceil(x.numel() / BAND_ELEMENTS))]
        e, h = quant_error(x, qt)
        eqs.append(e)
        how.add(h)
    e_q = max(eqs)
    rounding = 0.0
    if transform.startswith("norm_offset"):
        w = hf[0].double()
        rounding = 2.0**-24 * float((1 + w).norm() / w.norm().clamp_min(1e-300))
    b = BAND_K * e_q + rounding + FLOAT32_FLOOR
    n = max(x.numel() for x in hf)  # the cosine's own float64 evaluation error: gamma_n(2^-53)
    cos_min = math.sqrt(max(0.0, 1 - b * b)) - M.gamma(n, M.unit_roundoff(torch.float64))
    return b, {"rel_l2_max": b, "cosine_min": cos_min, "quant_rel_l2": e_q,
               "transform_rounding": rounding, "derivation": "; ".join(sorted(how))}


def _compare(got: list[torch.Tensor], want: list[torch.Tensor]) -> tuple[float, float]:
    """(worst rel_l2, worst cosine) over the source tensors; inf when shapes differ."""
    rel, cos = 0.0, 1.0
    for a, b in zip(got, want):
        if a.shape != b.shape:
            return math.inf, 0.0
        a, b = a.double(), b.double()  # once here: the metrics then skip their own float64 copies
        rel, cos = max(rel, M.rel_l2(a, b)), min(cos, M.cosine(a, b))
    return rel, cos


def _alternatives(p: _Pair, cfg: ModelConfig, arch: str) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """(what went wrong, the HF tensors the file would hold under that mistake), for one rule."""
    r, gg = p.rule, p.gg
    t0 = r.targets[0]
    kv = ".attn_k." in t0
    role = "n_head_kv" if kv else "n_head"
    if m := re.match(r"rope_permute\(n_head=(\d+)\)", r.transform):
        n = int(m[1])
        rows = gg[0].shape[0]
        for n2 in sorted({cfg.n_head, cfg.n_head_kv, 1, 2, 4, 8, 16, 32, 64}):
            if n2 != n and rows % (2 * n2) == 0:
                yield (f"{t0} matches {r.sources[0]} only after the RoPE permutation with {role}={n2} instead of {n}",
                       [layout.rope_unpermute(gg[0], n2)])
        yield f"{t0} matches {r.sources[0]} without the RoPE permutation (the converter did not permute it)", [gg[0]]
    elif r.transform == "copy" and re.search(r"\.attn_[qk]\.", t0) and gg[0].ndim >= 1:
        n = cfg.n_head_kv if kv else cfg.n_head
        if gg[0].shape[0] % (2 * n) == 0:
            yield (f"{t0} matches {r.sources[0]} only after undoing a RoPE permutation ({role}={n}) that {arch} "
                   "does not use (its rope rotates halves)", [layout.rope_unpermute(gg[0], n)])
    if r.transform.startswith("norm_offset"):
        yield f"{t0} lacks gemma's +1 norm offset (stored w instead of w + 1)", [gg[0]]
        yield f"{t0} has gemma's +1 norm offset applied twice", [gg[0] - 2]
    elif r.transform == "copy" and t0.endswith("norm.weight"):
        yield f"{t0} carries a +1 norm offset that {arch} does not use", [gg[0] - 1]
    if r.transform == "kv_b_split" and len(gg) == 2:
        k_b, v_b = gg
        if k_b.ndim == 3:
            try:
                yield (f"{t0} was written without its transpose ([H, Dn, R] instead of [H, R, Dn])",
                       [layout.kv_b_merge(k_b.transpose(1, 2), v_b)])
            except RuntimeError:
                pass
            try:
                yield (f"{t0} and {r.targets[1]} are exchanged (kv_b split in the wrong order)",
                       [layout.kv_b_merge(v_b.transpose(1, 2), k_b.transpose(1, 2))])
            except RuntimeError:
                pass
    if r.transform == "copy" and gg[0].ndim == 2:
        yield f"{t0} is stored transposed", [gg[0].t()]


def _block_peers(p: layout.Plan, r: layout.Rule) -> list[layout.Rule]:
    """Rules of the same tensor kind in other blocks (swap candidates)."""
    key = re.sub(r"^blk\.\d+\.", "blk.*.", r.targets[0])
    return [o for o in p.rules if o is not r and re.sub(r"^blk\.\d+\.", "blk.*.", o.targets[0]) == key]


def _numeric(p: layout.Plan, hf: HFSide, gg: dict[str, Any], cfg: ModelConfig) -> list[Finding]:
    if not hf.files:
        why = ("no HF config given" if hf.from_gguf else "--hf is a config.json, not a checkpoint directory"
               if hf.checkpoint is None else f"{hf.checkpoint} holds no *.safetensors")
        return [_finding("numeric", "skip", reason=f"numeric check needs an HF checkpoint (--hf DIR): {why}")]
    out = []
    cache: dict[str, torch.Tensor] = {}  # HF tensors of the rule at hand (and its swap candidates)

    def hf_t(name: str, rows: torch.Tensor | None) -> torch.Tensor | None:
        key = f"{name}@{'all' if rows is None else len(rows)}"
        if key not in cache:
            t = hf.tensor(name, rows)
            cache[key] = None if t is None else t.float()
        return cache[key]

    for r in p.rules:
        cache.clear()
        if any(t not in gg for t in r.targets):
            continue
        if any(s not in hf.files for s in r.sources):
            out.append(_finding(f"numeric/{r.targets[0]}", "skip",
                                reason=f"{_srcs(r)} is not in the checkpoint's safetensors"))
            continue
        if r.transform == "stack_experts":
            out.append(_numeric_experts(r, gg[r.targets[0]], hf))
            continue
        rows = _rows(gg[r.targets[0]]) if r.transform == "copy" else None
        pair = _Pair(r, [_dequant(gg[t], rows) for t in r.targets], [hf_t(s, rows) for s in r.sources], rows)
        fwd = r.forward(pair.hf) if rows is None else pair.hf
        b, budget = band(fwd, [gg[t].type for t in r.targets], pair.hf, r.transform)
        try:
            got = r.inverse(pair.gg) if rows is None else pair.gg
            rel, cos = _compare(got, pair.hf)
        except RuntimeError:
            rel, cos = math.inf, 0.0
        metrics = {"rel_l2": rel, "cosine": cos, "types": [gg[t].type.name for t in r.targets],
                   "rows_compared": None if rows is None else len(rows)}
        ok = rel <= b and cos >= budget["cosine_min"]
        target = f"numeric/{r.targets[0]}"
        if ok:
            out.append(_finding(target, "pass", f"{' + '.join(r.targets)} ~ {_srcs(r)} after {r.transform}: rel_l2 "
                                f"{rel:.3g} <= {b:.3g}, cosine {cos:.6f}", metrics=metrics, budget=budget))
            continue
        why = _explain(p, pair, hf_t, cfg, b)
        out.append(_finding(target, "fail", (why or f"{' + '.join(r.targets)} does not match {_srcs(r)} after "
                                             f"{r.transform}") + f" (rel_l2 {rel:.3g}, cosine {cos:.3f}, band {b:.3g})",
                            metrics=metrics, budget=budget, evidence=[{"explained_by": why}] if why else []))
    return out


def _numeric_experts(r: layout.Rule, t: Any, hf: HFSide) -> Finding:
    """A stacked-experts tensor [E, out, in] one expert at a time (the memory of one expert): slot e
    against checkpoint expert e, under the band of expert 0 (the experts of one tensor share their
    distribution). A failing slot is then matched against the layer's other experts (stored out of order)."""
    from ...gguf import dequantize

    slab = t.nbytes // t.shape[0]

    def slot(e: int) -> torch.Tensor:  # expert e's bytes are contiguous: [out, in]
        return dequantize(t.data[e * slab:(e + 1) * slab], t.type, t.shape[1:], device="cpu")

    b, budget, rel_w, cos_w, worst, bad = 0.0, {}, 0.0, 1.0, 0, []
    for e, src in enumerate(r.sources):
        want = hf.tensor(src).float()
        if e == 0:
            b, budget = band([want], [t.type], [want], r.transform)
        rel, cos = _compare([slot(e)], [want])
        if rel > rel_w:
            rel_w, worst = rel, e
        cos_w = min(cos_w, cos)
        if not (rel <= b and cos >= budget["cosine_min"]):
            bad.append(e)
    metrics = {"rel_l2": rel_w, "cosine": cos_w, "types": [t.type.name], "experts": len(r.sources),
               "worst_expert": worst, "experts_failed": len(bad)}
    if not bad:
        return _finding(f"numeric/{t.name}", "pass", f"{t.name} ~ {_srcs(r)}, expert by expert: worst rel_l2 "
                        f"{rel_w:.3g} <= {b:.3g} (expert {worst})", metrics=metrics, budget=budget)
    e, got = bad[0], slot(bad[0])
    why = next((f"{t.name} slot {e} holds {src} (expert {e2}): experts stored out of order"
                for e2, src in enumerate(r.sources) if e2 != e and _compare([got], [hf.tensor(src).float()])[0] <= b), "")
    return _finding(f"numeric/{t.name}", "fail", (why or f"{t.name}: {len(bad)} of {len(r.sources)} experts do not "
                                                  f"match, first expert {e} ({r.sources[e]})")
                    + f" (worst rel_l2 {rel_w:.3g}, band {b:.3g})", metrics=metrics, budget=budget,
                    evidence=[{"failed_experts": bad[:16]}])


def _explain(p: layout.Plan, pair: _Pair, hf_t: Callable, cfg: ModelConfig, b: float) -> str:
    """The first alternative transform (or swap partner) under which the tensor matches within the band."""
    for what, cand in _alternatives(pair, cfg, p.arch):
        rel, _ = _compare(cand, pair.hf)
        if rel <= b:
            return what
    r = pair.rule
    try:
        mine = r.inverse(pair.gg) if pair.rows is None else pair.gg
    except RuntimeError:
        return ""
    for o in _block_peers(p, r):
        theirs = [hf_t(s, pair.rows) for s in o.sources]
        if any(t is None for t in theirs):
            continue
        rel, _ = _compare(mine, theirs)
        if rel <= b:
            return (f"{r.targets[0]} holds {_srcs(o)}'s weights (the source of {o.targets[0]}): tensors swapped "
                    "across layers")
    return ""


# ---- engine ------------------------------------------------------------------------------------------

def _engine(subject: Any, p: layout.Plan, gg: dict[str, Any], hf: HFSide) -> list[Finding]:
    """The engine's own GGUF name map (vLLM: the vllm-gguf-plugin's `build_name_map`, GGUF name -> HF
    parameter, asked in the deployment's interpreter) diffed against ours. `subject`: the engine (its
    `gguf_name_map(hf_config)`, `name`, `title`), handed in by the caller; None: no engine's map."""
    if subject is None:
        return []
    who, key = subject.title, f"engine/{subject.name}"
    try:
        theirs = subject.gguf_name_map(hf.config)["map"]  # GGUF name -> HF name
    except EngineUnavailable as e:
        return [_finding(key, "skip", subject=subject.name, reason=f"{who}'s GGUF name map could not be asked: {e}")]
    except EngineError as e:  # the engine's own failure is the finding: it could not map this model
        return [_finding(key, "fail", f"{who}'s GGUF name map fails for this model: {e}", subject=subject.name)]
    ours = {t: r.sources for r in p.rules for t in r.targets}
    out = []
    for t in gg:
        if t not in theirs and t in ours:
            out.append(_finding(f"{key}/{t}", "fail", f"{who}'s map has no HF parameter for {t} (ours: "
                                f"{ours[t][0]}): {who} would not load it", subject=subject.name))
        elif t in theirs and t in ours and theirs[t] not in ours[t]:
            out.append(_finding(f"{key}/{t}", "fail", f"{who} maps {t} to {theirs[t]}, we to {ours[t][0]}",
                                subject=subject.name))
    for t, name in theirs.items():  # a parameter that needs no file tensor (a tied lm_head) is not expected
        if t not in gg and name in hf.shapes and name not in p.skipped:
            out.append(_finding(f"{key}/{t}", "fail", f"{who} expects {t} (for {name}), which the file does "
                                "not have", subject=subject.name))
    if not out:
        out.append(_finding(key, "pass", f"{who}'s GGUF name map agrees with ours on {len(gg)} tensors", subject=subject.name))
    return out


# ---- entry point -------------------------------------------------------------------------------------

@dataclass
class Result:
    findings: list[Finding]
    arch: str
    hf_source: str
    seconds: float


def run(path: Path, hf: Path | None = None, *, arch: str | None = None, engine: Any = None,
        numeric: bool = True, consumer: str | None = None, quantized_indexer: bool = False) -> Result:
    """Every mapping check of the GGUF at `path` against `hf` (checkpoint dir, config.json or None).
    `engine`: an engine whose own GGUF name map is diffed against ours (one with `gguf_name_map`: the caller
    makes it). `consumer`: the name of the engine that will load the file (diagnose's --engine; default the
    `engine`'s), and whether it consumes a quantized DSA indexer (its trait), for the tensor-type rules."""
    import time

    t0 = time.perf_counter()
    with open_gguf(path) as g:
        cfg = from_gguf(g)
        arch = arch or cfg.arch
        try:
            return _run(g, cfg, arch, hf, engine, numeric, t0, consumer or getattr(engine, "name", None),
                        quantized_indexer)
        except KeyError as e:  # a config.json without a field the architecture needs
            raise InputError(f"{hf or path}: the HF config lacks {e} (needed for {arch})") from None


def _run(g: Any, cfg: ModelConfig, arch: str, hf: Path | None, engine: Any, numeric: bool, t0: float,
         consumer: str | None, quantized_indexer: bool) -> Result:
    import time

    side = load_hf(hf, g, cfg)
    gg = {t.name: t for t in g.tensors}
    # files converted before llama.cpp's MLA split (PR 12801) keep kv_b_proj whole as attn_kv_b
    legacy_mla = any(n.endswith(".attn_kv_b.weight") for n in gg)
    p = layout.plan(arch, list(side.shapes), side.config, split_kv_b=not legacy_mla)
    findings = (_names(p, side, gg) + _collisions(p) + _shapes(p, side, gg) + _types(gg, consumer, quantized_indexer)
                + _metadata(cfg, g, side))
    if numeric:
        findings += _numeric(p, side, gg, cfg)
    findings += _engine(engine, p, gg, side)
    return Result(findings, arch, side.source, time.perf_counter() - t0)
