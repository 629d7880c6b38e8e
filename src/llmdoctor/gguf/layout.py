"""HF checkpoint <-> GGUF tensor layouts: names and every transform, each with its inverse.

A `Plan` lists, for one architecture, how each group of HF checkpoint tensors becomes GGUF tensors
(`Rule`: sources, targets, the transform's name and its forward and inverse). `to_gguf` runs the
forward direction (what llama.cpp's convert_hf_to_gguf.py does), `to_hf` the inverse. HF names are the
on-disk checkpoint names (per-expert `mlp.experts.{e}.*_proj.weight`, as save_pretrained writes and the
converter reads), not transformers' fused in-memory parameters.

Names come from gguf-py's TensorNameMap. In gguf 0.19 its constructor updates the *class-level*
`block_mappings_cfg` with per-architecture overrides (after an ARCTIC map is built, a LLAMA map loses
`post_attention_layernorm -> ffn_norm`). `name_map` therefore builds maps from a private copy of
gguf-py's tensor_mapping module, each map on its own copy of the table, so neither an earlier nor a
later construction anywhere in the process can change ours.

Transforms (convert_hf_to_gguf.py / conversion/*.py of llama.cpp):
- llama Q/K rows: `LlamaModel.permute` turns HF's rotate-half layout into adjacent pairs, per head of
  the tensor's own head count (n_head for Q, n_head_kv for K: under GQA K has fewer heads).
- gemma norms: HF stores w for a (1 + w) RMSNorm; the GGUF stores w + 1 (Gemma*Model.modify_tensors).
- MLA kv_b_proj [H*(Dn+Dv), R]: split per head into k_b transposed [H, R, Dn] and v_b [H, Dv, R]
  (DeepseekV2Model.modify_tensors, "MLA with the absorption optimization").
- experts: the per-expert 2-D tensors stacked into one [E, out, in] tensor per projection
  (ffn_{gate,up,down}_exps).
- `e_score_correction_bias` is renamed `e_score_correction.bias` before mapping (-> exp_probs_b.bias);
  a multimodal wrapper's `language_model.` is dropped (its text model's names remain).
- a tied lm_head is not written (the GGUF reuses token_embd); deepseek2 drops the multi-token-prediction
  layers past num_hidden_layers, glm-dsa keeps them as extra blocks (nextn tensors).
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

import gguf
import torch
from gguf import MODEL_ARCH, MODEL_ARCH_NAMES

from ..errors import InputError
from ..hf_config import text_config

Tensors = list[torch.Tensor]


# ---- names -------------------------------------------------------------------------------------------

@functools.cache
def _pristine_tensor_mapping():
    """A private copy of gguf-py's tensor_mapping module, loaded from its source (never mutated)."""
    src = importlib.util.find_spec("gguf.tensor_mapping").origin
    spec = importlib.util.spec_from_file_location("gguf._llmdoctor_tensor_mapping", src)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "gguf"  # its `from .constants import ...` resolves to gguf.constants
    spec.loader.exec_module(mod)
    return mod


def arch_of(name: str) -> MODEL_ARCH:
    for a, n in MODEL_ARCH_NAMES.items():
        if n == name:
            return a
    raise InputError(f"unknown GGUF architecture {name!r}")


@functools.lru_cache(maxsize=32)
def name_map(arch: str, n_blocks: int) -> gguf.TensorNameMap:
    """gguf-py's TensorNameMap for `arch`, immune to the class-level table mutation (see module doc)."""
    cls = _pristine_tensor_mapping().TensorNameMap
    m = cls.__new__(cls)
    m.block_mappings_cfg = {k: tuple(v) for k, v in cls.block_mappings_cfg.items()}  # shadows the class dict
    cls.__init__(m, arch_of(arch), n_blocks)
    return m


def gguf_name(arch: str, n_blocks: int, hf_name: str) -> str | None:
    """GGUF tensor name of an HF checkpoint tensor name (after the converter's renames), or None."""
    hf_name = re.sub(r"e_score_correction_bias$", "e_score_correction.bias", hf_name)
    # a multimodal wrapper's text model (Gemma3ForConditionalGeneration: model.language_model.* in
    # transformers 5, language_model.model.* before); the converter drops "language_model." (Gemma3Model)
    hf_name = hf_name.replace("language_model.", "")
    return name_map(arch, n_blocks).get_name(hf_name, try_suffixes=(".weight", ".bias"))


# ---- transforms (torch shapes, slowest dim first) ---------------------------------------------------

def rope_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> adjacent-pair rows, per head: [n_head * D, ...] (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of `rope_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def norm_offset(w: torch.Tensor) -> torch.Tensor:
    """gemma: HF's w of a (1 + w) RMSNorm -> the stored multiplier w + 1."""
    return w + 1


def norm_unoffset(w: torch.Tensor) -> torch.Tensor:
    return w - 1


def kv_b_split(kv_b: torch.Tensor, n_head: int, qk_nope: int, v_dim: int, *,
               copy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H*(Dn+Dv), R] -> k_b [H, R, Dn] (transposed), v_b [H, Dv, R]; `copy=False`: views of
    kv_b (the reference's products then sum in the same order as over the unsplit tensor)."""
    w = kv_b.reshape(n_head, qk_nope + v_dim, kv_b.shape[-1])
    k_b, v_b = w[:, :qk_nope].transpose(1, 2), w[:, qk_nope:]
    return (k_b.contiguous(), v_b.contiguous()) if copy else (k_b, v_b)


def kv_b_merge(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Inverse of `kv_b_split`: k_b [H, R, Dn], v_b [H, Dv, R] -> [H*(Dn+Dv), R]."""
    w = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, Dn+Dv, R]
    return w.reshape(-1, w.shape[-1])


def stack_experts(ws: Sequence[torch.Tensor]) -> torch.Tensor:
    """E tensors [out, in] -> [E, out, in]."""
    return torch.stack(list(ws), dim=0)


def unstack_experts(w: torch.Tensor) -> Tensors:
    return list(w.unbind(0))


def checkpoint_names(runtime_names: Sequence[str], n_experts: int) -> list[str]:
    """transformers 5's in-memory parameter names -> the checkpoint names `plan` takes: its fused
    `mlp.experts.gate_up_proj` [E, 2F, H] and `mlp.experts.down_proj` [E, H, F] come from per-expert
    `mlp.experts.{e}.{gate,up,down}_proj.weight` (conversion_mapping.py, "qwen2_moe" converters:
    MergeModulelist then Concatenate(dim=1), gate rows first)."""
    out: list[str] = []
    for name in runtime_names:
        m = re.match(r"^(.+\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out.append(name)
            continue
        projs = ("gate_proj", "up_proj") if m[2] == "gate_up_proj" else ("down_proj",)
        out.extend(f"{m[1]}.{e}.{p}.weight" for e in range(n_experts) for p in projs)
    return out


def checkpoint_shapes(runtime: dict[str, tuple[int, ...]], n_experts: int) -> dict[str, tuple[int, ...]]:
    """`checkpoint_names` with shapes: the fused gate_up_proj [E, 2F, H] gives per-expert gate/up [F, H],
    down_proj [E, H, F] per-expert down [H, F]; every other parameter keeps its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in runtime.items():
        names = checkpoint_names([name], n_experts)
        if names == [name]:
            out[name] = tuple(shape)
            continue
        per = (shape[1] // 2, shape[2]) if name.endswith("gate_up_proj") else tuple(shape[1:])
        out.update((n, per) for n in names)
    return out


# ---- plans -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    """HF `sources` -> GGUF `targets` by `transform` (its `forward`); `inverse` goes back."""

    sources: tuple[str, ...]
    targets: tuple[str, ...]
    transform: str  # "copy", "rope_permute(n_head=4)", "norm_offset(+1)", "kv_b_split", "stack_experts"
    forward: Callable[[Tensors], Tensors] = field(compare=False, repr=False)
    inverse: Callable[[Tensors], Tensors] = field(compare=False, repr=False)


@dataclass
class Plan:
    arch: str
    rules: list[Rule]
    unmapped: list[str]  # HF names with no GGUF name
    skipped: dict[str, str]  # HF name -> why it is legitimately not written

    def by_target(self) -> dict[str, Rule]:
        return {t: r for r in self.rules for t in r.targets}


def _copy(xs: Tensors) -> Tensors:
    return list(xs)


def _one(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], Tensors]:
    return lambda xs: [fn(xs[0])]


_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>\w+)\.weight$")
_MLA_ARCHS = ("deepseek2", "glm-dsa")
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def plan(arch: str, hf_names: Sequence[str], config: dict, *, split_kv_b: bool = True) -> Plan:
    """How convert_hf_to_gguf.py turns the checkpoint tensors `hf_names` of an HF model with `config`
    (config.json as a dict) into GGUF tensors of `arch`. `split_kv_b=False`: MLA's kv_b_proj kept whole
    as attn_kv_b, as converters before llama.cpp's MLA split (PR 12801) wrote it."""
    c = text_config(config)
    n_blocks = int(c["num_hidden_layers"])
    n_mtp = int(c.get("num_nextn_predict_layers") or 0)
    if arch == "glm-dsa":  # GlmMoeDsaModel keeps the NextN/MTP block(s) as extra blocks
        n_blocks += n_mtp
    n_head = int(c["num_attention_heads"])
    n_head_kv = int(c.get("num_key_value_heads") or n_head)
    rules: list[Rule] = []
    unmapped: list[str] = []
    skipped: dict[str, str] = {}
    experts: dict[tuple[str, str], dict[int, str]] = {}

    def target(name: str) -> str | None:
        t = gguf_name(arch, n_blocks, name)
        if t is None:
            unmapped.append(name)
        return t

    for name in hf_names:
        if name == "lm_head.weight" and c.get("tie_word_embeddings", False):
            skipped[name] = "tied to model.embed_tokens.weight (the GGUF reuses token_embd)"
            continue
        if arch == "deepseek2" and (b := re.match(r"model\.layers\.(\d+)\.", name)) and int(b[1]) >= n_blocks:
            skipped[name] = "multi-token-prediction layer (DeepseekV2Model.skip_mtp: not converted)"
            continue
        if m := _EXPERT.match(name):
            experts.setdefault((m["prefix"], m["proj"]), {})[int(m["e"])] = name
            continue
        if arch in _MLA_ARCHS and split_kv_b and name.endswith("kv_b_proj.weight"):
            tk = target(name.replace("kv_b_proj", "k_b_proj"))
            tv = target(name.replace("kv_b_proj", "v_b_proj"))
            if tk and tv:
                nope, vd = int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
                rules.append(Rule((name,), (tk, tv), "kv_b_split",
                                  lambda xs, nope=nope, vd=vd: list(kv_b_split(xs[0], n_head, nope, vd)),
                                  lambda xs: [kv_b_merge(xs[0], xs[1])]))
            continue
        t = target(name)
        if t is None:
            continue
        if arch == "llama" and re.search(r"\.(q_proj|k_proj)\.(weight|bias)$", name):
            nh = n_head if ".q_proj." in name else n_head_kv
            rules.append(Rule((name,), (t,), f"rope_permute(n_head={nh})",
                              _one(lambda w, nh=nh: rope_permute(w, nh)), _one(lambda w, nh=nh: rope_unpermute(w, nh))))
        elif arch in _GEMMA_ARCHS and name.endswith("norm.weight"):
            rules.append(Rule((name,), (t,), "norm_offset(+1)", _one(norm_offset), _one(norm_unoffset)))
        else:
            rules.append(Rule((name,), (t,), "copy", _copy, _copy))
    for (prefix, proj), by_e in sorted(experts.items()):
        n = len(by_e)
        if sorted(by_e) != list(range(n)):
            unmapped.extend(by_e.values())
            continue
        t = target(f"{prefix}.{proj}.weight")
        if t:
            rules.append(Rule(tuple(by_e[e] for e in range(n)), (t,), "stack_experts",
                              lambda xs: [stack_experts(xs)], lambda xs: unstack_experts(xs[0])))
    return Plan(arch, rules, unmapped, skipped)


def to_gguf(p: Plan, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint tensors -> GGUF tensors (torch shapes: the GGUF ne reversed)."""
    out: dict[str, torch.Tensor] = {}
    for r in p.rules:
        for name, t in zip(r.targets, r.forward([hf[s] for s in r.sources])):
            out[name] = t
    return out


def to_hf(p: Plan, gg: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF tensors -> HF checkpoint tensors (the inverse of `to_gguf`)."""
    out: dict[str, torch.Tensor] = {}
    for r in p.rules:
        for name, t in zip(r.sources, r.inverse([gg[s] for s in r.targets])):
            out[name] = t
    return out
