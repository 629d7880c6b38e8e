"""A live OpenAI-compatible endpoint as an engine, as far as HTTP allows: it tokenizes through the
server's tokenize route and generates greedily; it offers no full next-token distributions and no
activations (`run` is not offered: `probe` compares the top log-probs it returns)."""

from __future__ import annotations

from typing import Any

from ..endpoint import Endpoint
from .base import Deployment
from .base import Engine, EngineRun, Generation, NotOffered, RunInfo, Traits


class EndpointEngine(Engine):
    name = "endpoint"
    title = "the endpoint"
    distribution = "httpx"
    traits = Traits(formats=frozenset(), dequant_kernel=None, captures="none (HTTP shows no activations)",
                    noise="none: judged by the probes' own repeat and batch controls", in_process=False)

    def __init__(self, deployment):
        super().__init__(deployment)
        self._client: Endpoint | None = None

    @classmethod
    def over(cls, client: Endpoint) -> "EndpointEngine":
        """The engine speaking through an open client (the probe's own: one connection, one event log);
        closing the client stays its opener's."""
        engine = cls(Deployment(url=client.url))
        engine._client = client
        return engine

    def client(self) -> Endpoint:
        if self._client is None:
            if not self.deployment.url:
                raise NotOffered("endpoint: no URL (--endpoint)")
            self._client = Endpoint(self.deployment.url)
            self._client.resolve_model()
        return self._client

    def cannot_run(self) -> str | None:
        return None if self.deployment.url else "endpoint: no URL (--endpoint)"

    def run(self, tokens: list[int], config: Any = None) -> EngineRun:
        raise NotOffered("an endpoint returns top log-probs only, not every position's full distribution, and no "
                         "activations (`probe` compares what it returns)")

    def tokenize(self, text: str) -> list[int]:
        got = self.client().tokenize(text)
        if got is None:
            raise NotOffered(f"{self.deployment.url} has no tokenize route llmdoctor knows")
        self._route = got[1]
        return got[0]

    def front_end(self) -> dict[str, Any]:
        """The tokenize route used and its add-special rule (subjects/endpoint.py's `Endpoint.tokenize` asks
        for special tokens explicitly: llama.cpp's /tokenize defaults to add_special false, vLLM's to
        add_special_tokens true, llama-cpp-python's /extras/tokenize always adds BOS)."""
        route = getattr(self, "_route", None)
        return {"tokenizer": f"the server's, through {route or 'its tokenize route'}", "route": route,
                "add_special": ROUTE_ADD_SPECIAL.get(route, "unknown")}

    def generate(self, tokens: list[int], n: int, *, captures: bool = False) -> Generation:
        """Greedy completion of the token ids as `probe` asks it (temperature 0): the ids only; an endpoint
        returns top log-probs, not every step's full distribution, and no activations."""
        out = self.client().complete(tokens, max_tokens=n, logprobs=1)  # a completion prompt may be token ids
        if out.token_ids is None:
            raise NotOffered(f"{self.deployment.url} names generated tokens by text only, not by id")
        return Generation(list(out.token_ids), None, {}, RunInfo.of({"engine": self.name, "url": self.deployment.url}))

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "url": self.deployment.url, "model": self.client().model}

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# what each known tokenize route was asked for (subjects/endpoint.py), in words
ROUTE_ADD_SPECIAL = {"/extras/tokenize": "llama-cpp-python adds BOS as the model says (no switch)",
                     "/tokenize": "asked explicitly: llama.cpp add_special=true (its default false), vLLM "
                                  "add_special_tokens=true (its default true)"}
