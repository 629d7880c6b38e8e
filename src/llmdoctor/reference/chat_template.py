"""The reference's chat template rendering: a GGUF's `tokenizer.chat_template` rendered as transformers'
apply_chat_template renders it, in jinja2's immutable sandbox (a template is data from a file)."""

from __future__ import annotations


def render_chat_template(template: str, messages: list[dict[str, str]], *, bos: str, eos: str) -> str:
    """Render a GGUF chat template the way transformers' apply_chat_template does (trim_blocks,
    lstrip_blocks, raise_exception), in jinja2's immutable sandbox: a template is data from a
    file, it must not reach Python objects."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise ValueError(f"chat template: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            bos_token=bos, eos_token=eos)
