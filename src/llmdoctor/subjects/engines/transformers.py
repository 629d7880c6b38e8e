"""transformers as an engine under test: the GGUF's own (dequantized) weights, mapped back to the HF
checkpoint layout by gguf/layout.py's inverse transforms, run by transformers' own modeling code; or an
HF checkpoint directory loaded by transformers itself (`from_pretrained`), as a deployment serving it does.

This is what a deployment that serves a GGUF through transformers computes, minus transformers' GGUF
reader (which takes ~80 s on the demo file here): the weights are ours (bit-exact with gguf-py),
the arithmetic is transformers'. `dtype` is the deployment's precision (float16 reproduces the
float16-overflow failure of Gemma models). Captures: `l_out-{i}` (each decoder layer's output,
the residual stream, from `output_hidden_states`) and `result_output` (the logits).

HF config fields follow transformers' Gemma3TextConfig / LlamaConfig / Qwen2Config / Qwen3Config,
filled from the reference's `ModelConfig` (itself read from the GGUF metadata).
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

import numpy as np
import torch
from gguf import MODEL_TENSOR

from ...errors import InputError
from .base import Engine, EngineError, EngineRun, Generation, NotOffered, RunInfo, Traits


def build(path: str | os.PathLike, dtype: torch.dtype = torch.float32, dequantizer=None, device: str = "cpu"):
    """(model, config) with the GGUF's weights in transformers' layout, in `dtype`, on `device` (dequantized
    there, one layout rule at a time, so float32 copies of only one rule's tensors exist at once).
    `dequantizer` is the deployment's GGUF dequant kernel (default: ours, bit-exact)."""
    import transformers
    from transformers.initialization import no_init_weights

    from ...errors import InputError
    from ...gguf import layout, open_gguf
    from ...reference.config import from_gguf
    from ...reference.config_hf import hf_config
    from ...reference.forward import dequantize_raw

    dequantize = dequantizer or dequantize_raw

    with open_gguf(path) as g:
        cfg = from_gguf(g)
        try:
            config = hf_config(cfg, g)
        except InputError as e:
            raise EngineError(f"the transformers engine cannot build this model: {e}") from None
        hf_cfg = transformers.AutoConfig.for_model(**config)
        with no_init_weights(), torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
        names = list(model.state_dict())
        # HF parameter names as in a checkpoint: strip nothing (CausalLM keys are "model.layers...").
        legacy_kv_b = cfg.mla is not None and g.has_tensor("blk.0.attn_kv_b.weight")
        # transformers 5 keeps MoE experts fused in memory (checkpoints name them per expert): those
        # come from the stacked GGUF tensors below, the rest through the layout plan.
        fused = [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
        plan = layout.plan(cfg.arch, [n for n in names if n not in fused], config, split_kv_b=not legacy_kv_b)
        if plan.unmapped:
            raise EngineError(f"no GGUF source for HF parameters {plan.unmapped[:3]}")

        def tensor(name: str) -> torch.Tensor:
            t = g.tensor(name)
            return dequantize(t.data, t.type, t.shape, device=device)

        state = {}
        for r in plan.rules:
            one = layout.Plan(plan.arch, [r], [], {})
            state.update({k: v.to(dtype) for k, v in layout.to_hf(one, {n: tensor(n) for n in r.targets}).items()})
        for name in fused:
            state[name] = _fused_experts(name, tensor).to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m not in plan.skipped and not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise EngineError(f"state dict mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if cfg.tied_output:
        model.tie_weights()
    model.eval()
    return model, cfg


def from_checkpoint(directory: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """(model, config) of an HF checkpoint directory as a deployment serving it loads it:
    `AutoModelForCausalLM.from_pretrained` (local files only) in `dtype`, on the CPU."""
    import transformers

    from ...reference.config import from_hf

    cfg = from_hf(directory)
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype, local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError/KeyError/RuntimeError for what it cannot load
        raise EngineError(f"transformers cannot load {directory}: {type(e).__name__}: {e}") from None
    return model.eval(), cfg


def _fused_experts(name: str, tensor) -> torch.Tensor:
    """transformers 5's fused expert parameter `model.layers.{L}.mlp.experts.gate_up_proj`
    [E, 2*ff, n_embd] (gate rows, then up rows: its forward chunks the product in two) or `.down_proj`
    [E, n_embd, ff], from the GGUF's stacked ffn_{gate,up,down}_exps (row-major [E, ff, n_embd] and
    [E, n_embd, ff]); `tensor(name)` dequantizes one GGUF tensor."""
    from ...reference.forward import tensor_name

    il = int(name.split(".")[2])
    if name.endswith("gate_up_proj"):
        gate = tensor(tensor_name(MODEL_TENSOR.FFN_GATE_EXP, il))
        return torch.cat([gate, tensor(tensor_name(MODEL_TENSOR.FFN_UP_EXP, il))], dim=1)
    return tensor(tensor_name(MODEL_TENSOR.FFN_DOWN_EXP, il))


def _routers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer, router) for each MoE layer: the `mlp.gate` modules of DeepseekV3 / GlmMoeDsa, whose
    forward returns (router_logits, topk_weights, topk_indices)."""
    found = []
    for name, module in model.named_modules():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.gate", name)
        if m and type(module).__name__.endswith("TopkRouter"):
            found.append((int(m.group(1)), module))
    return found


def _routing_hook(into: dict[str, np.ndarray], il: int):
    """A forward hook keeping the experts a router chose, topk_indices [T, k] as int64, and what it
    read, the normed FFN input [T, n_embd] (the same captures as llama.cpp's `ffn_moe_topk-{il}` and
    `ffn_norm-{il}`)."""

    def hook(module, inputs, output):
        into[f"ffn_moe_topk-{il}"] = output[2].reshape(-1, output[2].shape[-1]).to(torch.int64).cpu().numpy()
        x = inputs[0]
        into[f"ffn_norm-{il}"] = x.reshape(-1, x.shape[-1]).float().cpu().numpy()

    return hook


def _indexers(model) -> list[tuple[int, torch.nn.Module]]:
    """(layer, indexer) for each layer with its own DSA indexer (GlmMoeDsa's `self_attn.indexer`; shared
    layers have none), whose forward returns the chosen key positions [B, T, k]."""
    return [(int(m.group(1)), module) for name, module in model.named_modules()
            if (m := re.fullmatch(r"model\.layers\.(\d+)\.self_attn\.indexer", name))
            and type(module).__name__.endswith("Indexer")]


def _selection_hook(into: dict[str, np.ndarray], il: int):
    """A forward hook keeping the keys an indexer chose, [T, k] as int64 (llama.cpp's `top_k-{il}`): the
    model leaves the choice among keys tied at the k-th score open, and the reference follows the engine's
    (diagnose/replay.py; the dsa-selection check judges the choice)."""

    def hook(module, inputs, output):
        into[f"top_k-{il}"] = output.reshape(-1, output.shape[-1]).to(torch.int64).cpu().numpy()

    return hook


def load(path: str | os.PathLike, dtype: torch.dtype, dequant_kernel: str | None = None, device: str = "cpu"):
    """(model, config) as the deployment loads it, on `device`: an HF checkpoint directory through
    `from_checkpoint`, a GGUF through `build` (dequantized by ours, or by the deployment's `dequant_kernel`,
    run isolated)."""
    if os.path.isdir(path):  # an HF checkpoint: transformers loads it itself
        if dequant_kernel:
            raise EngineError("a dequant kernel applies to GGUF weights: the engine runs an HF checkpoint")
        model, cfg = from_checkpoint(path, dtype)
        return model.to(device), cfg
    if dequant_kernel:
        from ..substitution import KernelDequantizer

        with KernelDequantizer(dequant_kernel) as kd:
            return build(path, dtype, kd, device=device)
    return build(path, dtype, device=device)


@torch.inference_mode()
def run(model, tokens: list[int], info: dict[str, Any]) -> EngineRun:
    """One forward pass of `tokens` through the loaded `model` (`load`), on its device: logits [T, V], l_out-{i},
    the routers' and indexers' choices; `info` is the engine's report of the run."""
    routing: dict[str, np.ndarray] = {}
    hooks = [module.register_forward_hook(_routing_hook(routing, il)) for il, module in _routers(model)]
    hooks += [module.register_forward_hook(_selection_hook(routing, il)) for il, module in _indexers(model)]
    try:
        out = model(torch.tensor([tokens], device=model.device), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    logits = out.logits[0].float().cpu().numpy()  # [T, V]
    # hidden_states[0] is the (scaled) embedding; hidden_states[i + 1] the output of layer i, except
    # that the last entry has the final norm applied (transformers' convention): drop it.
    caps = {f"l_out-{i}": h[0].float().cpu().numpy() for i, h in enumerate(out.hidden_states[1:-1])}
    caps.update(routing)
    caps["result_output"] = logits
    return EngineRun(np.ascontiguousarray(logits), caps, list(caps), RunInfo.of(info))


@torch.inference_mode()
def generate(model, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
    """Greedy decoding as transformers serves it: `model.generate` with its cache (DynamicCache), do_sample off,
    the raw logits of every step (`output_logits`; row 0 from the prompt's prefill). min_new_tokens=n keeps an
    end-of-sequence token from stopping it (its logits processor takes EOS out of the choice; the logits shown
    stay raw). `captures`: each decode step's layer outputs (`output_hidden_states`: entry i + 1 is layer i's
    output, the last one normed, so dropped) as l_out-{i} [n-1, n_embd]."""
    ids = torch.tensor([tokens], device=model.device)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, num_beams=1, use_cache=True, output_logits=True,
                         output_hidden_states=captures, return_dict_in_generate=True, pad_token_id=0)
    new = [int(t) for t in out.sequences[0, len(tokens):]]
    logits = torch.stack([step[0] for step in out.logits]).float().cpu().numpy()  # [n, V]
    caps = {}
    if captures and len(out.hidden_states) > 1:
        decode_steps = out.hidden_states[1:]  # step 0 is the prompt's prefill
        for il in range(len(decode_steps[0]) - 2):
            caps[f"l_out-{il}"] = torch.cat([st[il + 1][0, -1:] for st in decode_steps]).float().cpu().numpy()  # [n-1, D]
    info = {"engine": "transformers", "transformers": __import__("transformers").__version__,
            "dtype": str(model.dtype).removeprefix("torch."), "cache": "DynamicCache",
            "generate_s": round(time.perf_counter() - t0, 3)}
    return Generation(new, np.ascontiguousarray(logits), caps, RunInfo.of(info))


class TransformersEngine(Engine):
    """transformers' own modeling code, in this process: an HF checkpoint as `from_pretrained` loads it,
    or a GGUF's weights (dequantized by ours, or by the deployment's --dequant-kernel) in HF layout."""

    name = "transformers"
    title = "transformers"
    distribution = "transformers"
    traits = Traits(formats=frozenset({"gguf", "hf"}), dequant_kernel=None,
                    captures="each layer's output (hidden states), the routers' and indexers' choices",
                    noise="the reference in float64 for float32 (another draw of float32 rounding), else in the "
                          "engine's dtype", decode_captures="each decode step's layer outputs (hidden states)")

    # a planted decode fault (faults/decode.py: tests, --demo-fault): `plant(model)` hooks the model and returns
    # the handle to remove
    plant: Any = None

    def __init__(self, deployment):
        super().__init__(deployment)
        self._held: tuple[Any, Any] | None = None  # (model, config) as `load` built it, once
        self._front_end = None

    def _model(self):
        """The deployment's model, loaded on first use (torch on --threads threads first: the load's
        dequantization runs on them too) and kept until `close`."""
        d = self.deployment
        if d.threads:
            torch.set_num_threads(d.threads)
        if self._held is None:
            dtype = getattr(torch, d.dtype or "float32", None)
            if not isinstance(dtype, torch.dtype):
                raise InputError(f"unknown dtype {d.dtype!r}")
            self._held = load(d.model, dtype, d.dequant_kernel, d.device)
        return self._held[0]

    def run(self, tokens: list[int], config: Any = None) -> EngineRun:
        import transformers

        d = self.deployment
        return run(self._model(), tokens, {"engine": "transformers", "transformers": transformers.__version__,
                                           "dtype": d.dtype or "float32", "dequant_kernel": d.dequant_kernel or "llmdoctor",
                                           "device": d.device})

    def weights(self, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Layer `layer`'s parameters as the model built from the GGUF holds them (transformers 5's fused
        expert parameters left out: a checkpoint names experts one by one). With the deployment's dequant
        kernel, a build with ours (bit-exact) in the engine's dtype: the kernel is judged by check dequant, the
        loader here by what it does with exact weights."""
        from ...gguf import open_gguf
        from ...reference.config import from_gguf
        from ...reference.config_hf import hf_config

        d = self.deployment
        if not d.is_gguf:
            raise NotOffered("transformers runs the HF checkpoint itself: the reference reads the same files")
        model = build(d.model, getattr(torch, d.dtype or "float32"))[0] if d.dequant_kernel else self._model()
        with open_gguf(d.model) as g:
            config = hf_config(from_gguf(g), g)
        prefix = f"model.layers.{layer}."
        held = {name: t.detach().float().cpu().numpy() for name, t in model.state_dict().items()
                if name.startswith(prefix) and not name.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        return held, config

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        model = self._model()
        handle = self.plant(model) if self.plant is not None else None
        try:
            return generate(model, tokens, n, captures=captures)
        finally:
            if handle is not None:
                handle.remove()

    def close(self) -> None:
        """The model and the tokenizer let go (collected now: a model's modules refer to each other)."""
        if self._held is not None:
            import gc

            self._held = None
            gc.collect()
        self._front_end = None

    def describe(self) -> dict[str, Any]:
        import transformers

        return {**super().describe(), "transformers": transformers.__version__, "device": self.deployment.device}

    # ---- the front end: the tokenizer folder the deployment loads (hf_front.py) ----------------------
    def _front(self):
        from .hf_front import HFFrontEnd

        d = self.deployment
        folder = d.tokenizer or (d.model if d.model is not None and not d.is_gguf else None)
        if folder is None:
            raise NotOffered(GGUF_TOKENIZER_SLOW)
        if self._front_end is None:
            self._front_end = HFFrontEnd(folder)
        return self._front_end

    def tokenize(self, text: str) -> list[int]:
        return self._front().encode(text)

    def chat_tokenize(self, messages: list[dict[str, str]]) -> tuple[str | None, list[int]]:
        return self._front().chat(messages)

    def front_end(self) -> dict[str, Any]:
        return self._front().describe()


# transformers' own GGUF tokenizer conversion (AutoTokenizer.from_pretrained(gguf_file=...)) rebuilds the BPE
# merges from the vocab's scores: 50-60 s for the demo's 262,144 tokens on 2 loaded cores (measured), more
# than the whole diagnosis; the deployment's folder is named instead.
GGUF_TOKENIZER_SLOW = ("transformers running a GGUF tokenizes with what it converts from the file (AutoTokenizer "
                       "with gguf_file=, 50-60 s for the demo's 262,144-token vocab): not converted here; give the "
                       "deployment's tokenizer folder with --tokenizer DIR")
