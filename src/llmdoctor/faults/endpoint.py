"""Faults for `llmdoctor probe`: corrupted copies of a GGUF file for a real server, and a small
fault-injecting HTTP proxy in front of a real server for what an engine cannot be made to do.

File faults (kind "file"): `build(src, out_dir) -> Path` writes a corrupted copy of `src` into
`out_dir` (the original is never opened for writing). Proxy faults (kind "endpoint"):
`build(upstream_url, **options) -> FaultProxy`, a context manager whose `.url` is served on
127.0.0.1. `expect` is the symptom class (checks/endpoint/verdict.py) a correct probe must report.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable

import httpx
from gguf import GGUFValueType, Keys

from ..gguf import open_gguf
from . import register

# ---------------------------------------------------------------------------------------------
# file faults: corrupted copies of a model for a real server

# Types whose blocks start with the fp16 super-scale `d` (ggml-common.h block_q5_0 / q8_0 / q4_K /
# q5_K / q6_K ... put it first, except Q6_K which puts it last).
def _copy(src: Path, out_dir: Path, suffix: str) -> Path:
    dst = Path(out_dir) / f"{Path(src).stem}.{suffix}.gguf"
    shutil.copyfile(src, dst)
    return dst


@register("rope-base", "file",
          "<arch>.rope.freq_base in the metadata changed (1e6 -> 100): wrong positions in global attention",
          "position-dependent")
def rope_base(src: Path, out_dir: Path, *, value: float = 100.0) -> Path:
    """Overwrite the float32 `<arch>.rope.freq_base` value in a copy of `src` (same size, same layout)."""
    with open_gguf(src) as g:
        key = f"{g.architecture}.rope.freq_base"
        f = g.fields.get(key)
        if f is None or f.type != GGUFValueType.FLOAT32:
            raise ValueError(f"{src}: no float32 {key}")
        # KV record: key length (u64), key bytes, value type (u32), value
        value_offset = f.offset + 8 + len(key.encode()) + 4
    dst = _copy(src, out_dir, "rope-base")
    with open(dst, "r+b") as fh:
        fh.seek(value_offset)
        fh.write(struct.pack("<f", value))
    return dst


# ---------------------------------------------------------------------------------------------
# endpoint faults: a fault-injecting proxy in front of a real server

class FaultProxy:
    """An HTTP proxy on 127.0.0.1 (a free port) forwarding to `upstream`, with one fault.

    The fault sees each request body (`request`) and each buffered upstream response
    (`response`); a streamed response is buffered whole and replayed, chunk by chunk. Use as a
    context manager; `.url` is the proxy's base URL.
    """

    def __init__(self, upstream: str, fault: "_Fault"):
        self.upstream, self.fault = upstream.rstrip("/"), fault
        self._client = httpx.Client(base_url=self.upstream, timeout=600)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                proxy._handle(self, "GET")

            def do_POST(self) -> None:
                proxy._handle(self, "POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> "FaultProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()

    def _handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        n = int(h.headers.get("content-length") or 0)
        raw = h.rfile.read(n) if n else b""
        body = json.loads(raw) if raw else None
        path = h.path
        injected = self.fault.request(path, body)
        try:
            if injected is not None:
                status, data, ctype = injected
            else:
                r = self._client.request(method, path, json=body)
                status, data, ctype = r.status_code, r.content, r.headers.get("content-type", "application/json")
                status, data = self.fault.response(path, body, status, data)
        except (httpx.HTTPError, RuntimeError) as e:  # upstream gone, or the proxy closed meanwhile
            status, data, ctype = 502, json.dumps({"error": f"proxy: {e}"}).encode(), "application/json"
        finally:
            self.fault.done(path, body)
        try:
            h.send_response(status)
            h.send_header("content-type", ctype)
            h.send_header("content-length", str(len(data)))
            h.end_headers()
            h.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
            pass


class _Fault:
    """No fault: hooks that pass everything through. Subclasses override one or two."""

    def request(self, path: str, body: Any) -> tuple[int, bytes, str] | None:
        return None

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        return status, data

    def done(self, path: str, body: Any) -> None:
        pass


def _is_completion(path: str) -> bool:
    return path.startswith(("/v1/completions", "/v1/chat/completions"))


def _map_logprobs(path: str, data: bytes, fn: Callable[[int, float], float]) -> bytes:
    """Apply fn(step, logprob) to every token and top log-prob of a completion response (plain
    JSON or a buffered SSE stream); `step` counts generated tokens from 0."""

    def one(obj: dict, step0: int) -> int:
        step = step0
        for ch in obj.get("choices") or []:
            lp = ch.get("logprobs")
            if not isinstance(lp, dict) or "token_logprobs" not in lp:
                continue
            tl, tops = lp["token_logprobs"], lp.get("top_logprobs") or []
            for i in range(len(tl)):
                if tl[i] is not None:
                    tl[i] = fn(step + i, tl[i])
                if i < len(tops) and tops[i]:
                    tops[i] = {k: fn(step + i, v) for k, v in tops[i].items()}
            step += len(tl)
        return step

    if data.lstrip().startswith(b"data:"):
        steps = [0]

        def chunk(obj: dict) -> None:
            steps[0] = one(obj, steps[0])

        return _map_chunks(data, chunk)
    obj = json.loads(data)
    one(obj, 0)
    return json.dumps(obj).encode()


def _map_chunks(data: bytes, fn: Callable[[dict], None]) -> bytes:
    """Apply fn (in place) to every JSON chunk of a buffered server-sent event stream."""
    out = []
    for line in data.split(b"\n"):
        payload = line[5:].strip() if line.startswith(b"data:") else b""
        if payload and payload != b"[DONE]":
            obj = json.loads(payload)
            fn(obj)
            line = b"data: " + json.dumps(obj).encode()
        out.append(line)
    return b"\n".join(out)


class _CrossTalk(_Fault):
    """A request that arrives while another completion is in flight gets the other's prompt
    prepended (a KV-cache slot or batch row mix-up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[int, str] = {}

    def request(self, path: str, body: Any) -> None:
        if path.startswith("/v1/completions") and isinstance(body, dict):
            with self._lock:
                others = [p for k, p in self._inflight.items() if k != id(body)]
                self._inflight[id(body)] = body.get("prompt", "")
            if others:
                body["prompt"] = others[0] + "\n" + body["prompt"]
        return None

    def done(self, path: str, body: Any) -> None:
        with self._lock:
            self._inflight.pop(id(body), None)


class _Swap(_Fault):
    """Completions handed to the wrong request: a response that comes back while other requests of
    its kind (same route, streamed or not) are in flight goes to the earliest-arrived one still
    without an answer, not to its own; a request alone gets its own. The order requests finish in
    decides who gets what (a response queue matched to requests by completion order). The last
    request to finish of a batch often gets its own answer: only judging every request finds it."""

    def __init__(self, wait_s: float = 600.0) -> None:
        self.wait_s = wait_s
        self._cv = threading.Condition()
        self._waiting: dict[Any, list[int]] = {}  # kind -> request ids without an answer, arrival order
        self._answer: dict[int, tuple[int, bytes]] = {}  # request id -> the response it will get
        self._kind: dict[int, Any] = {}
        self._deposited: set[int] = set()

    def request(self, path: str, body: Any) -> None:
        if _is_completion(path) and isinstance(body, dict):
            kind = (path, bool(body.get("stream")))
            with self._cv:
                self._kind[id(body)] = kind
                self._waiting.setdefault(kind, []).append(id(body))
        return None

    def _hand_out(self, rid: int, answer: tuple[int, bytes]) -> None:
        """Give the response of request `rid` to the earliest waiting request other than `rid` (to
        `rid` itself when it waits alone). Under the lock."""
        waiting = self._waiting[self._kind[rid]]
        to = next((w for w in waiting if w != rid), rid)
        waiting.remove(to)
        self._answer[to] = answer
        self._cv.notify_all()

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        rid = id(body)
        with self._cv:
            if rid not in self._kind:
                return status, data
            self._deposited.add(rid)
            self._hand_out(rid, (status, data))
            if not self._cv.wait_for(lambda: rid in self._answer, timeout=self.wait_s):
                raise RuntimeError("no response was handed to this request")
            return self._answer.pop(rid)

    def done(self, path: str, body: Any) -> None:
        rid = id(body)
        with self._cv:
            kind = self._kind.pop(rid, None)
            if kind is None or rid in self._deposited:
                self._deposited.discard(rid)
                return
            # its upstream request failed: it leaves the queue and passes on what it was handed
            waiting = self._waiting[kind]
            if rid in waiting:
                waiting.remove(rid)
            elif rid in self._answer and waiting:
                self._answer[waiting.pop(0)] = self._answer.pop(rid)
                self._cv.notify_all()
            self._answer.pop(rid, None)


class _IgnoreEOS(_Fault):
    """Every completion and chat request gets a logit bias of -100 on the model's end tokens, as
    llama.cpp's `ignore_eos` does (it biases every end-of-generation token to -inf): generation runs
    on to max_tokens. The end tokens are read from `gguf` (default: the demo model): the metadata's
    eos / eot / eom ids and the tokens whose text is an end marker (checks/endpoint/prompts.py END_MARKERS)."""

    def __init__(self, gguf: Path | None = None) -> None:
        from ..checks.endpoint.prompts import END_MARKERS

        if gguf is None:
            from ..demo import model_path

            gguf = model_path()
        with open_gguf(gguf) as g:
            ids = {g.get(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)}
            tokens = g.get(Keys.Tokenizer.LIST)
            texts = tokens.decode_all() if tokens is not None else []
        ids |= {i for i, t in enumerate(texts) if t in END_MARKERS}
        self.bias = {str(i): -100.0 for i in sorted(i for i in ids if isinstance(i, int))}

    def request(self, path: str, body: Any) -> None:
        if _is_completion(path) and isinstance(body, dict):
            body["logit_bias"] = {**(body.get("logit_bias") or {}), **self.bias}
        return None


class _DecodePerturb(_Fault):
    """Decode steps only (generated token 1 onwards; the first comes from the prefill) have their
    log-probs sharpened 3x, as a wrong decode-path kernel would; prefill results are untouched."""

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        if status != 200 or not _is_completion(path) or (body or {}).get("echo"):
            return status, data
        return status, _map_logprobs(path, data, lambda step, lp: lp * 3.0 if step >= 1 else lp)


class _Nondeterministic(_Fault):
    """Every log-prob of a temperature-0 request jittered by up to +-0.3 nats (a race)."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _jitter(self, step: int, lp: float) -> float:
        with self._lock:
            return min(0.0, lp + self._rng.uniform(-0.3, 0.3))

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        if status != 200 or not _is_completion(path) or (body or {}).get("temperature", 1.0) != 0:
            return status, data
        return status, _map_logprobs(path, data, self._jitter)


class _Http500(_Fault):
    """Every `every`-th POST answered with HTTP 500 (an overloaded or crashing worker)."""

    def __init__(self, every: int = 2) -> None:
        self.every, self._n, self._lock = every, 0, threading.Lock()

    def request(self, path: str, body: Any) -> tuple[int, bytes, str] | None:
        if body is None:
            return None
        with self._lock:
            self._n += 1
            hit = self._n % self.every == 0
        return (500, b'{"error": "injected internal server error"}', "application/json") if hit else None


class _Malformed(_Fault):
    """Completion responses cut in half: not valid JSON."""

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        return (status, data[: len(data) // 2]) if _is_completion(path) else (status, data)


class _NoLogprobs(_Fault):
    """Completion responses without log-probs (a server that ignores the parameter)."""

    def response(self, path: str, body: Any, status: int, data: bytes) -> tuple[int, bytes]:
        if status != 200 or not _is_completion(path):
            return status, data
        if data.lstrip().startswith(b"data:"):
            return status, _map_chunks(data, _drop_logprobs)
        obj = json.loads(data)
        _drop_logprobs(obj)
        return status, json.dumps(obj).encode()


def _drop_logprobs(obj: dict) -> None:
    for ch in obj.get("choices") or []:
        ch["logprobs"] = None


class LogprobCap(_Fault):
    """Not a fault: requests asking for more than `cap` top log-probs rejected with HTTP 400, as
    OpenAI's API does (its limit is 5). The probe must detect the limit, not blame the server."""

    def __init__(self, cap: int = 5) -> None:
        self.cap = cap

    def request(self, path: str, body: Any) -> tuple[int, bytes, str] | None:
        if isinstance(body, dict) and (body.get("logprobs") or 0) > self.cap:
            return 400, json.dumps({"error": f"logprobs must be <= {self.cap}"}).encode(), "application/json"
        return None


class _Slow(_Fault):
    """Every request held for `delay` seconds before it is forwarded (past the client's timeout)."""

    def __init__(self, delay: float = 5.0) -> None:
        self.delay = delay

    def request(self, path: str, body: Any) -> None:
        time.sleep(self.delay)
        return None


def _endpoint_fault(name: str, description: str, expect: str, make: Callable[..., _Fault]) -> None:
    def build(upstream: str, **options: Any) -> FaultProxy:
        return FaultProxy(upstream, make(**options))

    build.__doc__ = description
    register(name, "endpoint", description, expect)(build)


_endpoint_fault("crosstalk", "a request arriving while another is in flight gets the other's prompt prepended",
                "batch-dependent", _CrossTalk)
_endpoint_fault("swap-responses", "a completion returning while others are in flight is handed to the earliest "
                "waiting other request (completion order decides)", "swapped-responses", _Swap)
_endpoint_fault("ignore-eos", "end tokens biased away (logit_bias -100, as llama.cpp's ignore_eos): "
                "generation runs to max_tokens", "eos-stop", _IgnoreEOS)
_endpoint_fault("decode-perturb", "log-probs of decode steps (generated token 1 on) sharpened 3x; prefill untouched",
                "decode-only", _DecodePerturb)
_endpoint_fault("nondeterministic", "log-probs of temperature-0 requests jittered by up to 0.3 nats",
                "nondeterministic", _Nondeterministic)
_endpoint_fault("http-500", "every 2nd POST answered with HTTP 500", "server-errors", _Http500)
_endpoint_fault("malformed-json", "completion responses truncated to half: invalid JSON", "malformed-json", _Malformed)
_endpoint_fault("no-logprobs", "completion responses stripped of their log-probs", "missing-logprobs", _NoLogprobs)
_endpoint_fault("slow", "every request held past the client's timeout", "timeout", _Slow)
