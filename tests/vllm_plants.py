"""Planted faults in vLLM for CPU (0.32) for issue 34's configured ladder: each breaks the engine only under
one serve option, so reverting that option makes it agree. The engine is broken by the test, never by
llmdoctor: `plant_env(kind, folder)` copies this file to `folder/sitecustomize.py` (with `folder/vllm_plant.txt`
naming the kind) and returns the environment that puts `folder` first on PYTHONPATH; llmdoctor's vLLM driver
inherits that environment (subjects/engines/vllm.py `_call`), so the deployment's interpreter imports this file
as `sitecustomize` at start. There it installs an import hook (a sys.meta_path finder) that patches the one vLLM
module the kind needs right after that module runs: nothing of vLLM is imported at interpreter start. The
vllm-venv has no sitecustomize of its own to shadow (checked: `import sitecustomize` fails there).

The kinds, each a bug class of public issues (notes/vllm-engine-args.md, "Planted faults for the configured
ladder", has the measurements and the rung that names each):
- "compiled-path": RotaryEmbedding.forward_native (the native form torch.compile traces: custom ops "none")
  rotates GPT-J pairs where the model wants NeoX halves; forward_cpu (the C++ kernel, custom ops "all" under
  --enforce-eager / -O0) is untouched. The class of vllm #31626/#31643 (the CPU kernel form and the native form
  of RotaryEmbedding/RMSNorm disagreed, seen under one compilation setting only).
- "prefix-cache-collision": kv_cache_utils.hash_block_tokens hashes a block's length, not its tokens, so a
  later request's full blocks at the same positions hit an earlier request's blocks and read their KV (the
  class of vllm #12621 / #8229, a block-hash collision serving another prompt's KV). Only with prefix caching;
  vLLM reads the cache only for requests without prompt logprobs (SamplingParams.skip_reading_prefix_cache).
- "graph-frozen-scale" (CUDA only): FlashAttentionImpl.forward uses a softmax scale of 1 / head_size while a CUDA
  graph is captured, so the FULL decode graphs replay it and eager attention never does (the class of vllm
  #27057/#27114, a graph capture that differs from the eager path). Named by the CUDA-graphs rung.
- "chunk-offset": GPUModelRunner._prepare_inputs gives the tokens of a prefill's later chunk (a request
  already scheduled, still inside its prompt) RoPE positions one too far; the KV slots stay right. Only when a
  prompt is longer than --max-num-batched-tokens. A prefix-cache hit (a new request starting past 0) is not
  shifted, so prefix caching off does not make it agree. The class of transformers #43082 and vllm #10388
  (positions of a later prefill chunk computed wrong).
- "loader-q-rows": LlamaForCausalLM.load_weights stores q_proj's rows per head in the adjacent-pair order that
  convert_hf_to_gguf's permutation gives a GGUF, while RoPE keeps NeoX halves: every configuration runs it, so no
  rung agrees (the class of the tiny llama Q8_0 GGUF through vllm-gguf-plugin 0.0.5 on the H100, bench/RESULTS.md).

Run as a script in vLLM's interpreter (`python vllm_plants.py SPEC.json OUT.json`), this file runs LLM(...)
configurations over requests and writes their logprobs: the tests' direct check of each plant."""

from __future__ import annotations

import os
import sys
from pathlib import Path

KINDS = ("compiled-path", "prefix-cache-collision", "chunk-offset", "graph-frozen-scale", "loader-q-rows")
KIND_FILE = "vllm_plant.txt"
FIRED: dict[str, int] = {}  # patched function -> calls (traced once under torch.compile); the runner reports it


def wrong_kv_scales_copy(src: Path, dst: Path, scales=((1e-3, 1.0), (1.0, 1e4))) -> Path:
    """A copy of checkpoint `src` at `dst` declaring an fp8 KV cache (compressed-tensors' kv_cache_scheme) with
    ModelOpt-named per-layer scales vLLM loads into each attention layer: `scales` [(k_scale, v_scale) per layer];
    the default saturates layer 0's keys (448 x 1e-3) and stores every layer-1 value as 0. The k_scale fault of
    issue 34 item 4, the engine's own loader untouched."""
    import json
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "dense", "config_groups": {}, "ignore": [],
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}}
    (dst / "config.json").write_text(json.dumps(cfg))
    sd = load_file(dst / "model.safetensors")
    for il, (k, v) in enumerate(scales):
        sd[f"model.layers.{il}.self_attn.k_proj.k_scale"] = torch.tensor(k)
        sd[f"model.layers.{il}.self_attn.v_proj.v_scale"] = torch.tensor(v)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def plant_env(kind: str, folder: Path) -> dict[str, str]:
    """The environment additions that plant `kind` in a vLLM interpreter started with them: PYTHONPATH with
    `folder` first (it receives sitecustomize.py and the kind)."""
    if kind not in KINDS:
        raise ValueError(f"unknown vLLM plant {kind!r}; one of {', '.join(KINDS)}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_bytes(Path(__file__).read_bytes())
    (folder / KIND_FILE).write_text(kind)
    rest = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(folder), *([rest] if rest else [])])}


# ---- the plants (run inside vLLM's interpreter, as sitecustomize) ------------------------------------------

def _fired(name: str) -> None:
    FIRED[name] = FIRED.get(name, 0) + 1


def _rope_native_pairs(module) -> None:
    """RotaryEmbedding.forward_native with the other pairing of rotated dimensions (GPT-J interleaved pairs
    for NeoX halves and back); forward_cpu, the C++ kernel, keeps the model's."""
    cls = module.RotaryEmbedding

    def forward_native(self, positions, query, key=None):
        _fired("RotaryEmbedding.forward_native")
        cache = self._match_cos_sin_cache_dtype(query)
        return self.forward_static(positions, query, key, self.head_size, self.rotary_dim, cache,
                                   not self.is_neox_style)

    cls.forward_native = forward_native


def _hash_ignores_tokens(module) -> None:
    """hash_block_tokens over the block's length instead of its token ids: the chain of parents and the
    extra keys (LoRA, multimodal, cache salt) stay, so blocks at the same positions collide."""
    original = module.hash_block_tokens

    def hash_block_tokens(hash_function, parent_block_hash, curr_block_token_ids, extra_keys=None):
        _fired("hash_block_tokens")
        return original(hash_function, parent_block_hash, (0,) * len(curr_block_token_ids), extra_keys)

    module.hash_block_tokens = hash_block_tokens


def _later_chunk_positions_shifted(module) -> None:
    """GPUModelRunner._prepare_inputs, then +1 on the positions of every request continuing a prefill (not
    new in this step, its computed tokens short of its prompt). The slot mapping is computed inside
    _prepare_inputs from the right positions, so only the model's RoPE sees the shift."""
    cls = module.GPUModelRunner
    original = cls._prepare_inputs

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        new = {r.req_id for r in scheduler_output.scheduled_new_reqs}
        start = 0
        for i, n in enumerate(int(x) for x in num_scheduled_tokens):
            req_id = self.input_batch.req_ids[i]
            done = int(self.input_batch.num_computed_tokens_cpu[i])
            if req_id not in new and done < self.requests[req_id].num_prompt_tokens:
                _fired("GPUModelRunner._prepare_inputs")
                self.positions[start:start + n] += 1  # positions: [tokens of the step], request by request
            start += n
        return out

    cls._prepare_inputs = _prepare_inputs


def _scale_frozen_at_capture(module):
    """FlashAttentionImpl.forward computing its softmax scale as 1 / head_size, not 1 / sqrt(head_size), while a
    CUDA graph is being captured: the graph replays that stale value, eager execution (cudagraph mode NONE) never
    sees it. Under FULL_AND_PIECEWISE only the FULL graphs of decode batches hold attention, so the prompt's
    prefill agrees and the generated steps do not. GPU only (no CUDA graphs on a CPU). The class of vllm
    #27057/#27114 (what a graph captured differs from what runs eagerly)."""
    import torch

    cls = module.FlashAttentionImpl
    original = cls.forward

    def forward(self, layer, query, *args, **kwargs):
        if not torch.cuda.is_current_stream_capturing():
            return original(self, layer, query, *args, **kwargs)
        _fired("FlashAttentionImpl.forward under capture")
        right = self.scale
        self.scale = 1.0 / query.shape[-1]  # query: [tokens, heads, head_size]
        try:
            return original(self, layer, query, *args, **kwargs)
        finally:
            self.scale = right

    cls.forward = forward


def _q_rows_in_gguf_order(module) -> None:
    """LlamaForCausalLM.load_weights with each q_proj weight's rows, per head, in convert_hf_to_gguf's RoPE order (the
    halves' rows interleaved as adjacent pairs), which the NeoX rotary then pairs wrongly."""
    cls = module.LlamaForCausalLM
    original = cls.load_weights

    def load_weights(self, weights):
        n_head = self.config.num_attention_heads

        def permuted(items):
            for name, w in items:
                if name.endswith("q_proj.weight"):
                    _fired("LlamaForCausalLM.load_weights q_proj")
                    # w: [n_head * head_dim, hidden] -> per head [2, head_dim / 2] rows, swapped to [head_dim / 2, 2]
                    w = w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
                yield name, w

        return original(self, permuted(weights))

    cls.load_weights = load_weights


PATCHES = {  # kind -> (the vLLM module, its patch)
    "compiled-path": ("vllm.model_executor.layers.rotary_embedding.base", _rope_native_pairs),
    "prefix-cache-collision": ("vllm.v1.core.kv_cache_utils", _hash_ignores_tokens),
    "chunk-offset": ("vllm.v1.worker.gpu_model_runner", _later_chunk_positions_shifted),
    "graph-frozen-scale": ("vllm.v1.attention.backends.flash_attn", _scale_frozen_at_capture),
    "loader-q-rows": ("vllm.model_executor.models.llama", _q_rows_in_gguf_order),
}


class _PatchAfterImport:
    """A sys.meta_path finder for one module: it finds the module's spec with the finders after it and makes
    the loader run `patch(module)` right after the module's own code."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)  # once: the finders after this one find the real spec
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module  # a source loader is made per module: wrapping it touches no other

        def exec_module(module):
            run(module)
            self.patch(module)
            print(f"llmdoctor test plant: patched {name} ({self.patch.__name__})", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


def install(kind: str) -> None:
    name, patch = PATCHES[kind]
    sys.meta_path.insert(0, _PatchAfterImport(name, patch))


# ---- the runner (run as a script in vLLM's interpreter) ------------------------------------------------------

def _summary(llm) -> dict:
    """What a plant depends on, as the running engine resolved it."""
    c = llm.llm_engine.vllm_config
    cc = c.compilation_config
    return {"compilation_mode": str(cc.mode), "backend": cc.backend, "custom_ops": list(cc.custom_ops),
            "rotary_embedding_custom_op": ("enabled" if "rotary_embedding" in cc.enabled_custom_ops else
                                           "disabled" if "rotary_embedding" in cc.disabled_custom_ops else "unused"),
            "enforce_eager": c.model_config.enforce_eager, "block_size": c.cache_config.block_size,
            "prefix_caching": c.cache_config.enable_prefix_caching,
            "chunked_prefill": c.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens}


def _rows(rows, vocab: int) -> list[list[float]]:
    """vLLM's per-position {token id: Logprob} dicts as dense rows of the vocabulary."""
    out = []
    for d in rows:
        row = [float("-inf")] * vocab
        for t, lp in d.items():
            row[t] = lp.logprob
        out.append(row)
    return out


def run(spec: dict) -> dict:
    """Each of spec["runs"] ({"name", "args": the `vllm serve` arguments after the model}) as vLLM's own
    parser resolves them, one engine after another in this process, over spec["requests"] ({"prompt": token
    ids, "max_tokens", "prompt_logprobs": bool}) in order, greedy, full-vocabulary logprobs."""
    import shlex
    import time

    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vocab = spec["vocab"]
    kind, fired = _planted()
    out = {"plant": kind, "runs": []}
    for r in spec["runs"]:
        ns = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
            ["--model", spec["model"], *shlex.split(r["args"])])
        kw = {**vars(EngineArgs.from_cli_args(ns)), "max_logprobs": vocab}
        t0 = time.perf_counter()
        llm = LLM(**kw)
        load_s = time.perf_counter() - t0
        got = []
        for q in spec["requests"]:
            sp = SamplingParams(max_tokens=q["max_tokens"], min_tokens=q["max_tokens"], temperature=0.0,
                                ignore_eos=True, logprobs=vocab, detokenize=False,
                                prompt_logprobs=vocab if q.get("prompt_logprobs") else None)
            o = llm.generate([TokensPrompt(prompt_token_ids=q["prompt"])], sp, use_tqdm=False)[0]
            got.append({"ids": list(o.outputs[0].token_ids), "logprobs": _rows(o.outputs[0].logprobs, vocab),
                        "prompt_logprobs": _rows(o.prompt_logprobs[1:], vocab) if o.prompt_logprobs else None,
                        "cached_tokens": o.num_cached_tokens})
        out["runs"].append({"name": r["name"], "args": r["args"], "load_s": round(load_s, 1),
                            "config": _summary(llm), "requests": got, "fired": dict(fired)})
        fired.clear()
        del llm
        cleanup_dist_env_and_memory()
    return out


def _planted() -> tuple[str | None, dict[str, int]]:
    """(the kind this interpreter was started with, its plant's calls so far), (None, {}) without a plant."""
    mod = sys.modules.get("sitecustomize")
    kind = Path(mod.__file__).with_name(KIND_FILE) if getattr(mod, "__file__", None) else None
    if kind is None or not kind.exists():
        return None, {}
    return kind.read_text().strip(), mod.FIRED


if __name__ == "sitecustomize" and Path(__file__).with_name(KIND_FILE).exists():
    install(Path(__file__).with_name(KIND_FILE).read_text().strip())

if __name__ == "__main__":
    import json

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process, as the driver's
    Path(sys.argv[2]).write_text(json.dumps(run(json.loads(Path(sys.argv[1]).read_text()))))
