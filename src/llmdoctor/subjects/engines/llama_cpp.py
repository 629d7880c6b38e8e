"""llama.cpp (through llama-cpp-python's ctypes API): logits for every position and the output of
every graph node, captured through the context's eval callback (`cb_eval`).

Node names are the ones llama.cpp's graph builders give through `cb(cur, "name", il)`:
`attn_norm-3`, `Qcur-3`, `kqv_out-3`, `ffn_inp-3`, `l_out-3`, `result_norm`, ... A name can be used
by several nodes of one layer (e.g. `Qcur-3` before and after RoPE): the last one evaluated wins,
which is the final value under that name, as the reference defines its capture points. F32/F16
nodes come back as float32, I32 nodes (the experts chosen, `ffn_moe_topk-3`) as int64.

The `ggml_tensor` struct is not exposed by llama-cpp-python; it is declared here from ggml.h and
checked at run time against ggml's own accessors (`ggml_get_name`, `ggml_nelements`) before any
value is trusted: a layout mismatch raises EngineError instead of returning garbage.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .base import Budget, Engine, EngineError, EngineRun, Generation, PieceRendering, RunInfo, Traits

GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64  # bytes
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32 = 0, 1, 26


class GGMLTensor(ctypes.Structure):
    """struct ggml_tensor (ggml.h). Verified at run time against ggml's accessors."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),  # elements per dim, fastest first
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),  # stride in bytes per dim
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


def _ggml_base() -> ctypes.CDLL:
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    candidates = sorted(lib_dir.glob("libggml-base.*"))
    if not candidates:
        raise EngineError(f"libggml-base not found in {lib_dir}")
    lib = ctypes.CDLL(str(candidates[0]))
    lib.ggml_get_name.restype = ctypes.c_char_p
    lib.ggml_get_name.argtypes = [ctypes.c_void_p]
    lib.ggml_nelements.restype = ctypes.c_int64
    lib.ggml_nelements.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_set.restype = None
    lib.ggml_backend_tensor_set.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_type_name.restype = ctypes.c_char_p
    lib.ggml_type_name.argtypes = [ctypes.c_int]
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    return lib


class _Capture:
    """The eval callback: asks for nodes whose names match, copies their values when computed."""

    def __init__(self, lib: ctypes.CDLL, patterns: tuple[str, ...]):
        self.lib, self.patterns = lib, patterns
        self.captures: dict[str, np.ndarray] = {}
        self.names: list[str] = []
        self.error: str | None = None
        self.tamper: Callable[[int, bool], None] | None = None  # a planted fault's view of every node (generate)
        self.fn = _eval_callback_type()(self._callback)

    def _wanted(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def _callback(self, t_ptr: int, ask: bool, _user: int) -> bool:
        try:
            if self.tamper is not None:
                self.tamper(t_ptr, ask)
            name = (self.lib.ggml_get_name(t_ptr) or b"").decode("utf-8", "replace")
            if ask:
                self.names.append(name)
                return self._wanted(name)
            if self._wanted(name):
                self.captures[name] = self._read(t_ptr, name)
        except Exception as e:  # never raise through C
            self.error = self.error or f"{type(e).__name__}: {e}"
        return True

    def _read(self, t_ptr: int, name: str) -> np.ndarray:
        t = GGMLTensor.from_address(t_ptr)
        if t.name.decode("utf-8", "replace") != name or int(np.prod(list(t.ne))) != self.lib.ggml_nelements(t_ptr):
            raise EngineError("ggml_tensor layout mismatch between ggml.h and the loaded libggml")
        dtype = {GGML_TYPE_F32: np.float32, GGML_TYPE_F16: np.float16, GGML_TYPE_I32: np.int32}.get(t.type)
        if dtype is None:
            raise EngineError(f"node {name} has ggml type {t.type}, not F32/F16/I32")
        span = self.lib.ggml_nbytes(t_ptr)
        raw = np.empty(span, dtype=np.uint8)
        self.lib.ggml_backend_tensor_get(t_ptr, raw.ctypes.data, 0, span)
        ne = [int(x) for x in t.ne]
        nb = [int(x) for x in t.nb]
        while len(ne) > 1 and ne[-1] == 1:  # drop trailing unit dims
            ne.pop()
            nb.pop()
        view = np.lib.stride_tricks.as_strided(raw.view(dtype), shape=tuple(reversed(ne)),
                                               strides=tuple(reversed(nb)))
        # row-major, slowest first (ne reversed); indices (I32, e.g. ffn_moe_topk) stay integers
        return view.astype(np.int64 if dtype is np.int32 else np.float32)


def _eval_callback_type():
    import llama_cpp

    return llama_cpp.ggml_backend_sched_eval_callback


@contextlib.contextmanager
def loaded(model_path: str | os.PathLike):
    """(llama_cpp module, model) of the model on llama.cpp's CPU backend (mapped, no layer offloaded); freed on
    exit. A context per run or generation is made on it (`_context`)."""
    import llama_cpp as L

    L.llama_backend_init()
    L.llama_log_set(_silent_log(), ctypes.c_void_p())
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.use_mmap = True
    from ...gguf.split import first_shard  # llama.cpp opens a split model from its first shard only

    model = L.llama_model_load_from_file(os.fsencode(first_shard(model_path)), mparams)
    if not model:
        raise EngineError(f"llama.cpp could not load {model_path}")
    try:
        yield L, model
    finally:
        L.llama_model_free(model)


@contextlib.contextmanager
def _context(held, n_ctx: int, n_batch: int, *, n_threads: int | None, flash_attn: bool, cap: "_Capture | None"):
    """(llama_cpp module, context, n_vocab, info) on the `loaded` model `held`, its KV cache of the context's
    default type (F16), `cap` as the eval callback; the context freed on exit."""
    L, model = held
    ctx = None
    try:
        cparams = L.llama_context_default_params()
        cparams.n_ctx = max(n_ctx, 8)
        cparams.n_batch = cparams.n_ubatch = n_batch
        threads = n_threads or max(1, os.cpu_count() or 1)
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
        cparams.no_perf = True
        if cap is not None:
            cparams.cb_eval = cap.fn
        ctx = L.llama_init_from_model(model, cparams)
        if not ctx:
            raise EngineError("llama.cpp could not create a context")
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        kv = cap.lib if cap is not None else _ggml_base()
        info = {"engine": "llama.cpp", "llama_cpp_python": L.__version__, "n_threads": threads, "flash_attn": flash_attn,
                "kv_cache_type": f"{kv.ggml_type_name(cparams.type_k).decode()}/{kv.ggml_type_name(cparams.type_v).decode()}"}
        yield L, ctx, n_vocab, info
    finally:
        if ctx:
            L.llama_free(ctx)


class _Batch:
    """A llama_batch of up to `size` tokens of sequence 0, freed on close."""

    def __init__(self, L, size: int):
        self.L, self.size, self.batch = L, size, L.llama_batch_init(size, 0, 1)

    def decode(self, ctx, tokens: list[int], pos0: int, *, logits: str = "last") -> None:
        """llama_decode of `tokens` at positions pos0, pos0 + 1, ...; logits for every token ("all") or the last."""
        b = self.batch
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if logits == "all" or i == len(tokens) - 1 else 0
        b.n_tokens = len(tokens)
        rc = self.L.llama_decode(ctx, b)
        if rc != 0:
            raise EngineError(f"llama_decode returned {rc} at position {pos0}")

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)


def run(model_path: str | os.PathLike, tokens: list[int], *, capture: tuple[str, ...] = (),
        n_threads: int | None = None, flash_attn: bool = False, held=None) -> EngineRun:
    """Decode `tokens` in one batch on llama.cpp's CPU backend; logits for every position.

    `capture`: fnmatch patterns of node names to copy out (empty: none, "*": all). `held`: the model
    already `loaded` from `model_path` (else loaded for this run alone).
    """
    if not tokens:
        raise EngineError("no tokens")
    if held is None:
        with loaded(model_path) as held:
            return run(model_path, tokens, capture=capture, n_threads=n_threads, flash_attn=flash_attn, held=held)
    n = len(tokens)
    cap = _Capture(_ggml_base(), tuple(capture)) if capture else None
    with _context(held, n, n, n_threads=n_threads, flash_attn=flash_attn, cap=cap) as (L, ctx, n_vocab, info):
        batch = _Batch(L, n)
        try:
            batch.decode(ctx, tokens, 0, logits="all")
        finally:
            batch.close()
        if cap is not None and cap.error:
            raise EngineError(cap.error)
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(n, n_vocab)).copy()  # [T, n_vocab]
        return EngineRun(logits, cap.captures if cap else {}, cap.names if cap else [], RunInfo.of(info))


@dataclass
class DecodeStep:
    """What a planted decode fault (faults/decode.py; tests and --demo-fault only) sees of the decode loop: the
    step about to run (1..n-1: the decode steps; the prompt's batch is step 0 and is not shown), the position
    it feeds, the prompt's length, llama.cpp's API (`L`, `lib`: libggml-base) and the context, and `decode`
    (tokens, pos0) to put other tokens into the KV cache."""

    index: int
    position: int
    prompt_len: int
    L: Any
    lib: ctypes.CDLL
    ctx: Any
    decode: Callable[[list[int], int], None]


def generate(model_path: str | os.PathLike, tokens: list[int], n: int, *, capture: tuple[str, ...] = (),
             n_threads: int | None = None, flash_attn: bool = False, plant: str | None = None,
             held=None) -> Generation:
    """Greedy decoding as llama.cpp serves (its server's slot loop): the prompt in one batch, then one
    llama_decode per generated token over the context's KV cache, the next token the argmax of the last
    logits (llama.cpp's greedy sampler: the first of equal maxima, as numpy's argmax). `capture`: fnmatch
    patterns of the nodes copied out of every decode step (not the prompt's batch). `plant`: a planted
    decode fault, "module:factory" of an object with `before(step)` and/or `node(step, tensor, ask)`
    (faults/decode.py), resolved here, in the engine's process. `held`: as `run`'s."""
    if not tokens or n < 1:
        raise EngineError("generate needs a prompt and at least one new token")
    if held is None:
        with loaded(model_path) as held:
            return generate(model_path, tokens, n, capture=capture, n_threads=n_threads, flash_attn=flash_attn,
                            plant=plant, held=held)
    p = len(tokens)
    fault = _resolve_plant(plant) if plant else None
    cap = _Capture(_ggml_base(), ()) if capture or fault is not None else None
    with _context(held, p + n, p, n_threads=n_threads, flash_attn=flash_attn, cap=cap) as (L, ctx, n_vocab, info):
        batch = _Batch(L, p)
        rows: list[np.ndarray] = []  # [V] per step
        steps: list[dict[str, np.ndarray]] = []  # the captures of each decode step
        ids: list[int] = []
        t0 = time.perf_counter()
        try:
            batch.decode(ctx, tokens, 0)
            t_prefill = time.perf_counter() - t0
            for i in range(n):
                if i:
                    step = DecodeStep(i, p + i - 1, p, L, cap.lib if cap else None, ctx,
                                      lambda toks, pos0: batch.decode(ctx, toks, pos0))
                    if cap is not None:
                        cap.patterns, cap.captures = tuple(capture), {}
                        cap.tamper = (lambda t, ask, st=step: fault.node(st, t, ask)) \
                            if hasattr(fault, "node") else None
                    if hasattr(fault, "before"):
                        fault.before(step)
                    batch.decode(ctx, [ids[-1]], p + i - 1)
                    if cap is not None:
                        if cap.error:
                            raise EngineError(cap.error)
                        steps.append(cap.captures)
                row = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, -1), shape=(n_vocab,)).copy()  # [V]
                rows.append(row)
                ids.append(int(row.argmax()))
        finally:
            batch.close()
        captures = {name: np.stack([st[name] for st in steps]) for name in (steps[0] if steps else {})
                    if all(name in st for st in steps)}  # [n-1, ...]: a decode step's row dim (1) was dropped
        info.update(prefill_s=round(t_prefill, 3), decode_s=round(time.perf_counter() - t0 - t_prefill, 3),
                    planted=plant)
        return Generation(ids, np.stack(rows), captures, RunInfo.of(info))


def _resolve_plant(spec: str):
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)()


def serve() -> Callable:
    """Handler factory for `subjects.isolation.Isolated`: each request is one `run` or `generate` (the header's
    "command" and arguments) on the model the child keeps loaded (loaded by the first request for its path, a
    request for another path replaces it); the reply's payload is the pickled EngineRun or Generation, or the
    header says the engine's error. The reply header's `loaded` says whether this request loaded the model."""
    os.environ["GGML_NO_BACKTRACE"] = "1"  # an abort is reported by the parent, without a gdb dump
    kept: dict[str, Any] = {}  # {"path", "held"}: the model loaded last, freed by `stack`
    stack = contextlib.ExitStack()

    def model(path: str) -> tuple[Any, bool]:
        """(the `loaded` model at `path`, whether this request loaded it)."""
        if kept.get("path") == path:
            return kept["held"], False
        stack.close()  # the model of another path goes first
        kept.clear()
        kept.update(held=stack.enter_context(loaded(path)), path=path)
        return kept["held"], True

    def handle(header: dict, payload: bytearray) -> tuple[dict, bytes]:
        common = dict(capture=tuple(header["capture"]), n_threads=header["n_threads"], flash_attn=header["flash_attn"])
        try:
            m, fresh = model(header["model_path"])
            if header["command"] == "generate":
                result = generate(header["model_path"], header["tokens"], header["n"], plant=header["plant"], held=m,
                                  **common)
            else:
                result = run(header["model_path"], header["tokens"], held=m, **common)
        except EngineError as e:
            return {"status": "engine-error", "message": str(e)}, b""
        return {"status": "ok", "loaded": fresh}, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)

    return handle


_SERVE = "llmdoctor.subjects.engines.llama_cpp:serve"  # the child's handler factory


def _isolated(header: dict[str, Any], timeout: float, child: Any = None) -> Any:
    """One request to `serve` in a child process (`child`: an `Isolated` kept across requests; else one for
    this request alone): an abort inside llama.cpp (a GGML_ASSERT on a file it cannot run), a crash or a hang
    becomes an EngineError naming what happened, not the end of this process (the next request on `child`
    starts a fresh one)."""
    from ..isolation import Isolated, LoadFailed

    try:
        if child is None:
            with Isolated(_SERVE, (), call_timeout=timeout) as iso:
                out = iso.call(header, b"")
        else:
            child.call_timeout = timeout
            out = child.call(header, b"")
    except LoadFailed as e:
        raise EngineError(f"llama.cpp could not be started in a child process ({e.kind}: {e})") from None
    if out.status == "ok":
        return pickle.loads(out.payload)
    if out.status == "engine-error":
        raise EngineError(out.message)
    what = {"crashed": "llama.cpp crashed", "timeout": "llama.cpp did not finish"}.get(out.status, "llama.cpp failed")
    raise EngineError(f"{what} on {Path(header['model_path']).name}: {out.message}")


def run_isolated(model_path: str | os.PathLike, tokens: list[int], *, capture: tuple[str, ...] = (),
                 n_threads: int | None = None, flash_attn: bool = False, timeout: float = 3600.0,
                 child: Any = None) -> EngineRun:
    """`run` in a child process (`child`: as `_isolated`'s). `timeout` covers loading and the whole prefill (an
    hour: a large model mapped from a cold disk)."""
    return _isolated({"command": "run", "model_path": os.fspath(model_path), "tokens": [int(t) for t in tokens],
                      "capture": list(capture), "n_threads": n_threads, "flash_attn": flash_attn}, timeout, child)


def generate_isolated(model_path: str | os.PathLike, tokens: list[int], n: int, *, capture: tuple[str, ...] = (),
                      n_threads: int | None = None, flash_attn: bool = False, plant: str | None = None,
                      timeout: float = 3600.0, child: Any = None) -> Generation:
    """`generate` in a child process (as `run_isolated`)."""
    return _isolated({"command": "generate", "model_path": os.fspath(model_path), "tokens": [int(t) for t in tokens],
                      "n": int(n), "capture": list(capture), "n_threads": n_threads, "flash_attn": flash_attn,
                      "plant": plant}, timeout, child)


_LOG_CB = None


def _silent_log():
    """A log callback that drops llama.cpp's chatter (kept alive for the process lifetime)."""
    global _LOG_CB
    if _LOG_CB is None:
        import llama_cpp as L

        _LOG_CB = L.llama_log_callback(lambda level, text, user: None)
    return _LOG_CB


class VocabPieces:
    """llama.cpp's vocab of a model, loaded alone (no weights): its rendering of single tokens
    (llama_token_to_piece, no lstrip) as `pieces(token_id, special) -> bytes`, and its tokenizer
    (`tokenize`). A context manager."""

    def __init__(self, model_path: str | os.PathLike):
        import llama_cpp as L

        self._L = L
        L.llama_backend_init()
        L.llama_log_set(_silent_log(), ctypes.c_void_p())
        params = L.llama_model_default_params()
        params.vocab_only = True
        self._model = L.llama_model_load_from_file(os.fsencode(model_path), params)
        if not self._model:
            raise EngineError(f"llama.cpp could not load the vocab of {model_path}")
        self._vocab = L.llama_model_get_vocab(self._model)
        self._buf = ctypes.create_string_buffer(256)

    def __call__(self, token_id: int, special: bool) -> bytes:
        n = self._L.llama_token_to_piece(self._vocab, token_id, self._buf, len(self._buf), 0, special)
        if n < 0:  # the piece is longer than the buffer: -n bytes are needed
            self._buf = ctypes.create_string_buffer(-n)
            n = self._L.llama_token_to_piece(self._vocab, token_id, self._buf, len(self._buf), 0, special)
        return self._buf.raw[:n]

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """llama_tokenize of `text` as llama.cpp's server tokenizes a prompt (add_special: BOS/EOS as the
        model's metadata says; parse_special: text that spells a special token is that token)."""
        raw = text.encode("utf-8")
        n_max = len(raw) + 8
        for _ in range(2):
            buf = (self._L.llama_token * n_max)()
            n = self._L.llama_tokenize(self._vocab, raw, len(raw), buf, n_max, add_special, parse_special)
            if n >= 0:
                return list(buf[:n])
            n_max = -n  # too small: -n tokens are needed
        raise EngineError(f"llama_tokenize failed on {len(raw)} bytes")

    def close(self) -> None:
        if self._model:
            self._L.llama_model_free(self._model)
            self._model = None

    def __enter__(self) -> "VocabPieces":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The graph nodes a diagnosis captures, and the node names that differ from the reference's capture
# names (llama.cpp's graph builders call the attention block's residual sum `sa_out`).
CAPTURE = ("l_out-*", "attn_norm-*", "kqv_out-*", "sa_out-*", "ffn_norm-*", "ffn_out-*", "ffn_moe_topk-*", "top_k-*",
           "result_norm")
NODE_ALIASES = {"sa_out": "ffn_inp"}


def to_reference_names(captures: Mapping[str, Any]) -> dict[str, Any]:
    """Rename llama.cpp's nodes `alias-i` to the reference's `name-i`; other names pass through."""
    out = {}
    for name, value in captures.items():
        base, sep, idx = name.rpartition("-")
        out[f"{NODE_ALIASES[base]}{sep}{idx}" if sep and base in NODE_ALIASES else name] = value
    return out


class LlamaCppEngine(PieceRendering, Engine):
    """llama.cpp's CPU backend through llama-cpp-python, in a child process (an abort inside llama.cpp
    is a finding, not the end of the diagnosis) kept for every run and generation, the model loaded in it
    once; a crashed or hung child is replaced by a fresh one on the next request."""

    name = "llama.cpp"
    title = "llama.cpp"
    distribution = "llama-cpp-python"
    traits = Traits(formats=frozenset({"gguf"}), dequant_kernel="ggml",
                    captures="every graph node, through the context's eval callback",
                    noise="the reference with llama.cpp's CPU arithmetic emulated (Q8 activations, F16 KV cache)",
                    decode_captures="each decode step's graph nodes, as its prefill's")

    plant: str | None = None  # a planted decode fault, "module:factory" (faults/decode.py: tests, --demo-fault)

    def __init__(self, deployment):
        super().__init__(deployment)
        self._child = None  # the Isolated child serving this engine's requests, started on the first
        self._hf_front = None

    def child(self):
        from ..isolation import Isolated

        if self._child is None:
            self._child = Isolated(_SERVE, ())
        return self._child

    def run(self, tokens: list[int], config: Any = None) -> EngineRun:
        out = run_isolated(self.deployment.model, tokens, n_threads=self.deployment.threads, capture=CAPTURE,
                           child=self.child())
        out.captures = to_reference_names(out.captures)
        return out

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        out = generate_isolated(self.deployment.model, tokens, n, n_threads=self.deployment.threads,
                                capture=CAPTURE if captures else (), plant=self.plant, child=self.child())
        out.captures = to_reference_names(out.captures)
        return out

    def close(self) -> None:
        """The child process ended (and with it the model it loaded)."""
        if self._child is not None:
            self._child.close()
            self._child = None
        self._hf_front = None

    def noise_budget(self, ran: EngineRun) -> Budget:
        from ...reference.emulate import LLAMA_CPP_CPU

        return Budget("float32", LLAMA_CPP_CPU, "llama.cpp arithmetic (Q8 activations, F16 KV)")

    def tokenize(self, text: str) -> list[int]:
        return self.tokenize_all([text], [])[0][0]

    def chat_tokenize(self, messages: list[dict[str, str]]) -> tuple[str | None, list[int]]:
        got = self.tokenize_all([], [messages])[1][0]
        if isinstance(got, Exception):
            raise got
        return got

    def tokenize_all(self, texts: list[str], conversations: list[list[dict[str, str]]]
                     ) -> tuple[list[list[int]], list[Any]]:
        """As llama-cpp-python's server tokenizes: with an HF tokenizer folder (`hf_pretrained_model_name_or_path`)
        through its LlamaHFTokenizer (add_special_tokens=True) and, for a chat, its `hf-autotokenizer` format (the
        folder's template rendered, then tokenized by LlamaHFTokenizer, which passes add_special_tokens=True
        whatever add_bos says); else llama_tokenize with add_special and parse_special, and a chat through the
        GGUF's tokenizer.chat_template in its Jinja2ChatFormatter, tokenized without added specials (the
        template writes BOS). The vocab is loaded once."""
        from .base import NotOffered

        chats: list[Any] = []
        if self.deployment.tokenizer is not None:
            for conv in conversations:
                try:
                    chats.append(self._hf().chat(conv, add_special_tokens=True))
                except NotOffered as e:
                    chats.append(e)
            return [self._hf().encode(t) for t in texts], chats
        from ...gguf import open_gguf

        with open_gguf(self.deployment.model) as g:
            template, bos, eos = (g.get(f"tokenizer.{k}") for k in ("chat_template", "ggml.bos_token_id",
                                                                    "ggml.eos_token_id"))
        with VocabPieces(self.deployment.model) as vocab:
            for conv in conversations:
                if not isinstance(template, str) or not template:
                    chats.append(NotOffered(f"{self.deployment.model.name} carries no tokenizer.chat_template "
                                            "(llama.cpp's chat route then falls back to a built-in format, not the "
                                            "model's)"))
                    continue
                from llama_cpp.llama_chat_format import Jinja2ChatFormatter

                text_of = lambda tid: "" if tid is None else vocab(int(tid), True).decode("utf-8", "replace")  # noqa: E731
                res = Jinja2ChatFormatter(template, eos_token=text_of(eos), bos_token=text_of(bos))(messages=conv)
                chats.append((res.prompt, vocab.tokenize(res.prompt, add_special=not res.added_special,
                                                         parse_special=True)))
            return [vocab.tokenize(t) for t in texts], chats

    def front_end(self) -> dict[str, Any]:
        if self.deployment.tokenizer is not None:
            return {**self._hf().describe(chat_add_special=True),
                    "as": "llama-cpp-python with hf_pretrained_model_name_or_path"}
        return {"tokenizer": f"the GGUF's ({self.deployment.model})", "loaded_by": "llama_tokenize",
                "add_special": True, "parse_special": True}

    def _hf(self):
        from .hf_front import HFFrontEnd

        if self._hf_front is None:
            self._hf_front = HFFrontEnd(self.deployment.tokenizer)
        return self._hf_front

    def piece_reader(self) -> "VocabPieces":
        return VocabPieces(self.deployment.model)

    def describe(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {**super().describe(), "llama_cpp_python": version(self.distribution), "device": "cpu"}
