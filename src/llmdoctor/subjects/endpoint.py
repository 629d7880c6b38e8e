"""A client for an OpenAI-compatible HTTP endpoint, as a subject of `llmdoctor probe`.

Speaks the OpenAI REST shapes (/v1/models, /v1/completions with legacy `logprobs`/`echo`,
/v1/chat/completions, server-sent events for `stream`), plus the tokenize routes of the engines we
know (llama-cpp-python `/extras/tokenize`, llama.cpp server and vLLM `/tokenize`).

Log-probs by token id: every completion and chat request sets vLLM's `return_tokens_as_token_ids`
(vLLM's protocol.py: tokens and top_logprobs keys become "token_id:<id>"); llama.cpp's servers ignore
the unknown field. Where the server honours it, a `Completion` carries the ids and the text of each
id (the caller's `pieces`, else the server's `/detokenize`); elsewhere only the decoded text.

The API key is read from an environment variable and only ever placed in the Authorization header;
it is never part of an error, a repr or a report. Every failed attempt (connection error, timeout,
HTTP 5xx/429, malformed JSON) is recorded in `Endpoint.events`, also when a retry recovered it,
so that a server that errors is never reported as healthy.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import httpx

from ..completion import Completion, EndpointError
from ..errors import InputError

_RETRY_STATUS = {429, 500, 502, 503, 504}
_TOKEN_ID = re.compile(r"token_id:(\d+)")  # vLLM's format_token_id_placeholder


@dataclass
class Endpoint:
    """An OpenAI-compatible server at `url` (with or without the trailing /v1)."""

    url: str
    model: str | None = None
    api_key_env: str | None = None
    timeout: float = 60.0
    retries: int = 2
    backoff: float = 0.5
    events: list[dict[str, Any]] = field(default_factory=list)
    n_requests: int = 0
    token_ids: bool = True  # ask for log-probs keyed by token id (vLLM's return_tokens_as_token_ids)
    pieces: Callable[[int], str | None] | None = None  # id -> text (None: unknown); else the server's /detokenize

    def __post_init__(self) -> None:
        base = self.url.rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        if not base.startswith(("http://", "https://")):
            raise InputError(f"{self.url}: not an http(s) URL")
        self.base = base
        headers = {"content-type": "application/json"}
        if self.api_key_env:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise InputError(f"environment variable {self.api_key_env} (the API key) is not set")
            headers["authorization"] = f"Bearer {key}"
        self._client = httpx.Client(base_url=base, headers=headers, timeout=self.timeout)
        self._texts: dict[int, str] = {}  # id -> the server's /detokenize text

    def __repr__(self) -> str:  # never shows the key
        return f"Endpoint({self.base!r}, model={self.model!r})"

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "Endpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport -------------------------------------------------------------------------

    def _record(self, path: str, kind: str, detail: str, attempt: int) -> None:
        self.events.append({"path": path, "kind": kind, "detail": detail[:200], "attempt": attempt})

    def _request(self, method: str, path: str, body: dict | None = None, *, stream: bool = False) -> Any:
        """JSON (or the list of SSE data objects when `stream`) of one request, with bounded retries.

        Retried: connection errors, timeouts, HTTP 429/5xx, malformed JSON; backoff doubles each time.
        Not retried: other HTTP 4xx (the request itself is wrong or unsupported).
        """
        url = self.base + path
        last: EndpointError | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            self.n_requests += 1
            try:
                if stream:
                    with self._client.stream(method, path, json=body) as r:
                        if r.status_code >= 400:
                            r.read()
                            raise _http_error(url, r)
                        return list(_sse_objects(url, r.iter_lines()))
                r = self._client.request(method, path, json=body)
                if r.status_code >= 400:
                    raise _http_error(url, r)
                try:
                    return r.json()
                except ValueError as e:
                    raise EndpointError("malformed", url, f"response is not JSON ({e}): {r.text[:80]!r}") from None
            except httpx.TimeoutException:
                last = EndpointError("timeout", url, f"no complete response within {self.timeout:g} s")
            except httpx.TransportError as e:
                last = EndpointError("connect", url, f"{type(e).__name__}: {e}")
            except EndpointError as e:
                last = e
                if e.kind == "http" and e.status not in _RETRY_STATUS:
                    self._record(path, e.kind, e.detail, attempt)
                    raise
            self._record(path, last.kind, last.detail, attempt)
        assert last is not None
        raise last

    # -- API -------------------------------------------------------------------------------

    def models(self) -> list[str]:
        data = self._request("GET", "/v1/models")
        try:
            return [m["id"] for m in data["data"]]
        except (KeyError, TypeError):
            raise EndpointError("malformed", self.base + "/v1/models", "no data[].id in the model list") from None

    def resolve_model(self) -> str:
        """The model name to send: the given one, else the first one the server lists."""
        if self.model is None:
            names = self.models()
            if not names:
                raise EndpointError("malformed", self.base + "/v1/models", "the server lists no model")
            self.model = names[0]
        return self.model

    def complete(self, prompt: str, *, max_tokens: int = 1, logprobs: int | None = None, echo: bool = False,
                 stream: bool = False, stop: list[str] | None = None, temperature: float = 0.0,
                 seed: int | None = None) -> Completion:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": stream}
        if logprobs is not None:
            body["logprobs"] = logprobs
        if echo:
            body["echo"] = True
        if stop:
            body["stop"] = stop
        if seed is not None:
            body["seed"] = seed
        return self._generate("/v1/completions", body, stream=stream, chat=False)

    def chat(self, messages: list[dict[str, str]], *, max_tokens: int = 32, stream: bool = False,
             logprobs: int | None = None) -> Completion:
        """A greedy chat turn; with `logprobs`, each generated token's top log-probs (OpenAI's
        `logprobs: true, top_logprobs: k`)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0.0, "stream": stream}
        if logprobs is not None:
            body.update(logprobs=True, top_logprobs=logprobs)
        return self._generate("/v1/chat/completions", body, stream=stream, chat=True)

    def _generate(self, path: str, body: dict[str, Any], *, stream: bool, chat: bool) -> Completion:
        """One completion or chat request; log-probs keyed by token id where the server honours it."""
        t0 = time.perf_counter()
        if self.token_ids:
            body["return_tokens_as_token_ids"] = True
        data = self._request("POST", path, body, stream=stream)
        out = _merge_chunks(self.base, data, chat=chat) if stream else _completion(self.base, data, chat=chat)
        if _keyed_by_ids(out) and not self._name_ids(out):
            self.token_ids = False  # ids nobody can name: ask for text from now on
            return self._generate(path, {k: v for k, v in body.items() if k != "return_tokens_as_token_ids"},
                                  stream=stream, chat=chat)
        out.elapsed = time.perf_counter() - t0
        return out

    def _name_ids(self, out: Completion) -> bool:
        """Move "token_id:<id>" tokens and keys to `token_ids` / `top_ids` and put each id's text in
        their place; False when an id has no text (no `pieces`, no /detokenize route)."""
        ids = [int(_TOKEN_ID.fullmatch(t)[1]) for t in out.tokens or []]
        tops = [None if top is None else {int(_TOKEN_ID.fullmatch(k)[1]): v for k, v in top.items()}
                for top in out.top_logprobs or []]
        try:
            out.tokens = [self.piece(i) for i in ids]
            out.top_logprobs = [None if top is None else {self.piece(i): v for i, v in top.items()} for top in tops]
        except EndpointError:
            return False
        out.token_ids, out.top_ids = ids, tops
        return True

    def piece(self, token_id: int) -> str:
        """The text of one token id: `pieces` where given, else the server's /detokenize (cached)."""
        text = self.pieces(token_id) if self.pieces is not None else None
        if text is not None:
            return text
        if token_id not in self._texts:
            try:
                data = self._request("POST", "/detokenize", {"model": self.model, "tokens": [token_id]})
            except EndpointError as e:
                if e.kind == "http" and e.status in (400, 404, 405, 422):
                    self.events.pop()  # no such route: feature detection, not a server error
                raise
            text = data.get("prompt") if isinstance(data, dict) else None
            if not isinstance(text, str):
                raise EndpointError("malformed", self.base + "/detokenize", "no prompt text in the answer")
            self._texts[token_id] = text
        return self._texts[token_id]

    def tokenize(self, text: str) -> tuple[list[int], str] | None:
        """The server's token ids for `text` as a completion prompt would get them, and the route
        used; None when the server has no tokenize route we know."""
        routes = (("/extras/tokenize", {"input": text}),  # llama-cpp-python
                  ("/tokenize", {"content": text, "add_special": True}),  # llama.cpp server
                  ("/tokenize", {"prompt": text, "add_special_tokens": True}))  # vLLM
        for path, body in routes:
            try:
                data = self._request("POST", path, {"model": self.model, **body})
            except EndpointError as e:
                if e.kind == "http" and e.status in (400, 404, 405, 422):
                    self.events.pop()  # an unknown route is feature detection, not a server error
                    continue
                raise
            toks = data.get("tokens") if isinstance(data, dict) else None
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return toks, path
            if isinstance(toks, list) and all(isinstance(t, dict) and "id" in t for t in toks):
                return [t["id"] for t in toks], path  # llama.cpp with_pieces
        return None


def _keyed_by_ids(c: Completion) -> bool:
    """Every returned token and top-k key is vLLM's "token_id:<id>" (the request's ids were honoured)."""
    keys = [k for top in c.top_logprobs or [] if top for k in top]
    return bool(c.tokens) and all(_TOKEN_ID.fullmatch(t) for t in [*c.tokens, *keys])


def _http_error(url: str, r: httpx.Response) -> EndpointError:
    return EndpointError("http", url, f"HTTP {r.status_code}: {r.text[:120]!r}", status=r.status_code)


def _sse_objects(url: str, lines: Iterator[str]) -> Iterator[dict]:
    """The JSON objects of a server-sent event stream, up to `data: [DONE]`."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        payload = line[len("data:"):].strip()
        if payload == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except ValueError:
            raise EndpointError("malformed", url, f"stream chunk is not JSON: {payload[:80]!r}") from None


def _choice(url: str, data: Any) -> dict:
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise EndpointError("malformed", url, "response has no choices[0]") from None
    if not isinstance(choice, dict):
        raise EndpointError("malformed", url, "choices[0] is not an object")
    return choice


def _logprobs(lp: Any) -> tuple[list[str], list[float | None], list[dict[str, float] | None]] | None:
    """Legacy completion logprobs, or chat `logprobs.content`, as (tokens, logprobs, top dicts)."""
    if not isinstance(lp, dict):
        return None
    if "tokens" in lp:
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        return list(lp["tokens"]), list(lp.get("token_logprobs") or []), list(tops)
    if isinstance(lp.get("content"), list):
        items = lp["content"]
        return ([c["token"] for c in items], [c.get("logprob") for c in items],
                [{t["token"]: t["logprob"] for t in c.get("top_logprobs") or []} or None for c in items])
    return None


def _completion(url: str, data: Any, chat: bool = False) -> Completion:
    choice = _choice(url, data)
    text = (choice.get("message") or {}).get("content") if chat else choice.get("text")
    if not isinstance(text, str) and not (chat and text is None):
        raise EndpointError("malformed", url, "choices[0] has no text")
    out = Completion(text=text or "", finish_reason=choice.get("finish_reason"), usage=data.get("usage") or {})
    try:
        lp = _logprobs(choice.get("logprobs"))
    except (TypeError, KeyError, ValueError, AttributeError) as e:
        raise EndpointError("malformed", url, f"choices[0].logprobs is malformed ({type(e).__name__}: {e})") from None
    if lp is not None:
        out.tokens, out.token_logprobs, out.top_logprobs = lp
    return out


def _merge_chunks(url: str, chunks: list[dict], chat: bool = False) -> Completion:
    """One Completion from the chunks of a stream (text concatenated, logprobs appended)."""
    out = Completion(text="", finish_reason=None, usage={})
    for data in chunks:
        if data.get("usage"):
            out.usage = data["usage"]
        if not data.get("choices"):
            continue
        choice = _choice(url, data)
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        out.text += piece or ""
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        lp = _logprobs(choice.get("logprobs"))
        if lp is not None:
            out.tokens = (out.tokens or []) + lp[0]
            out.token_logprobs = (out.token_logprobs or []) + lp[1]
            out.top_logprobs = (out.top_logprobs or []) + lp[2]
    return out
