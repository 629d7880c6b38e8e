"""The configured deployment's requests (issue 34), planned: the engine that runs the deployment's own command line,
the configuration it resolved, and the tokens of the requests that reach what the prompt cannot (a prompt longer than
the token budget; a second request sharing the first one's KV blocks). configured.py judges them; hypotheses.py
`family` counts their judged items before they run."""

from __future__ import annotations

from typing import Any

from ..subjects.engines.base import Engine, Reconfigurable
from .session import Session, Skip

PREFIX_STEPS = 4  # generated steps of the prefix-cache request (step 0 is computed over the cached blocks)


def configured_engine(s: Session) -> Engine:
    """The engine under test when it runs the deployment's own command line; a Skip saying why not."""
    engine = s.engine()
    if not isinstance(engine, Reconfigurable) or s.inputs.engine_args is None:
        raise Skip("no deployment command line (--engine-args with --engine vllm): the engine runs llmdoctor's own "
                   "configuration, which turns none of the deployment's options on")
    return engine


def resolved(s: Session) -> dict[str, Any]:
    """The configuration the engine resolved from the deployment's command line (its prompt run shows it), with
    whether VLLM_ATTENTION_BACKEND was set."""
    info = s.engine_run().info.details.get("engine_config") or {}
    got = dict(info.get("resolved") or {})
    if not got:
        raise Skip("the engine did not report the configuration it resolved")
    got["backend_env"] = (info.get("env") or {}).get("read", {}).get("VLLM_ATTENTION_BACKEND")
    got["asked"] = info.get("asked") or {}
    return got


# the options a request needs that vLLM may resolve off: (in words, the flag that asks for it)
_OPTIONS = {"chunked_prefill": ("chunked prefill", "--enable-chunked-prefill"),
            "prefix_caching": ("prefix caching", "--enable-prefix-caching")}


def _off(cfg: dict[str, Any], key: str) -> Skip:
    """Why option `key` is off in the resolved configuration: the command line turned it off, or left it to vLLM, or
    asked for it and vLLM turned it off (vllm_driver.py `asked`)."""
    words, flag = _OPTIONS[key]
    said = (cfg.get("asked") or {}).get(key)
    why = {True: f"the command line asks for it ({flag}), and vLLM turned it off when it resolved the configuration "
                 "for this model on this platform",
           False: f"the command line turns it off ({flag.replace('--enable-', '--no-enable-')})",
           None: "the command line leaves it to vLLM, whose resolution for this model on this platform turns it off"}
    return Skip(f"{words} is off in this configuration: {why[said]}")


def _context(s: Session) -> int:
    """The positions the model holds (a GGUF's context_length, a checkpoint's max_position_embeddings); vLLM
    refuses a longer model length."""
    import json

    if s.inputs.gguf is not None:
        got = s.gguf().get(f"{s.config().arch}.context_length")
    else:
        cfg = json.loads((s.reference_path() / "config.json").read_text())
        got = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get("max_position_embeddings")
    return int(got) if got else 1 << 30


def _repeated(tokens: list[int], n: int) -> list[int]:
    return (tokens * (n // len(tokens) + 1))[:n]


def planned_items(s: Session) -> int:
    """The items the configured requests judge beyond the prompt's and the decode steps' (hypotheses.py `family`):
    two per position of the chunked-prefill request and of the prefix-cache request's steps, and each one's mean KL;
    0 without a deployment command line."""
    try:
        configured_engine(s)
        cfg = resolved(s)
    except Skip:
        return 0
    n = 0
    try:
        n += 2 * len(long_prompt(s, cfg)) + 1
    except Skip:  # chunked prefill off, or no room for a longer prompt: no such request
        pass
    try:
        prefix_requests(s, cfg)
        n += 2 * PREFIX_STEPS + 1
    except Skip:  # prefix caching off, or no prefix can be shared: no such request
        pass
    return n


def long_prompt(s: Session, cfg: dict[str, Any]) -> list[int]:
    """The chunked-prefill request's tokens: the prompt when it is longer than the token budget, else the prompt
    repeated to the budget plus a quarter of it (at least 8 more); a Skip when chunked prefill is off or the model
    cannot hold that many positions."""
    if not cfg.get("chunked_prefill"):
        raise _off(cfg, "chunked_prefill")
    budget, prompt = int(cfg["max_num_batched_tokens"]), s.tokens()
    if len(prompt) > budget:
        return prompt
    n = budget + max(8, budget // 4)
    if n > _context(s):
        raise Skip(f"a prompt longer than the token budget ({budget}: --max-num-batched-tokens) does not fit the model's "
                   f"{_context(s)} positions: chunked prefill cannot run")
    return _repeated(prompt, n)


def prefix_requests(s: Session, cfg: dict[str, Any]) -> tuple[list[int], list[int], int]:
    """(first request, second request, tokens they share): the second shares the first's leading full KV blocks,
    then holds a full block of other tokens at the positions where the first has its next block (a cache that
    served that block of the first would be wrong) and one token more. The prompt repeated where it is too short."""
    if not cfg.get("prefix_caching"):
        raise _off(cfg, "prefix_caching")
    b, prompt = int(cfg.get("block_size") or 16), s.tokens()
    first = prompt if len(prompt) >= 2 * b + 1 else _repeated(prompt, 2 * b + 1)
    if len(first) + PREFIX_STEPS > _context(s):
        raise Skip(f"two KV blocks of {b} tokens and a token more do not fit the model's positions: no prefix can be shared")
    shared = b * ((len(first) - b - 1) // b)
    own = first[shared:shared + b + 1][::-1]
    if own == first[shared:shared + b + 1]:  # a palindrome: rotate instead
        own = own[1:] + own[:1]
    if own == first[shared:shared + b + 1]:
        raise Skip("the prompt's tokens are all one token: no second request with other tokens can be made of them")
    return first, first[:shared] + own, shared
