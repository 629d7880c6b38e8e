"""Planted decode-path faults: an engine whose prefill is right and whose generation over its KV cache is not.

Each fault's `build(engine)` plants itself into an engine instance (llama.cpp: a "module:factory" the engine's
child process resolves and calls in its decode loop, `LlamaCppEngine.plant`; transformers: a hook on its model
for the decode steps, `TransformersEngine.plant`) and returns the engine. `diagnose` plants one through
`Inputs.engine_plant` (tests, `--demo-fault`); the judgement is never touched. What each must be diagnosed as:
"decode path", first wrong at generated step 2 (step 1 comes out of the prompt's prefill; the first decode
step is step 2, 1-based as the report counts).
"""

from __future__ import annotations

import ctypes
from typing import Any

from . import register

_HERE = __name__


# ---- llama.cpp: run inside its child process (subjects/engines/llama_cpp.py `generate`, DecodeStep) ----------

class RopeAtPreviousPosition:
    """Every decode step's RoPE reads position p-1 for its token at position p: in the step's graph the first
    ROPE node's positions tensor (inp_pos, int32 [n_tokens], shared by every layer's Q and K rotation) is
    lowered by one after llama.cpp has filled it and before the graph computes (the eval callback's `ask`
    pass sees every node before any is computed). The causal mask and the cache slot stay right: a decode
    kernel handed the wrong position. Its K goes into the cache rotated at p-1, as such a kernel's would."""

    def __init__(self) -> None:
        self.done: int | None = None  # the step whose positions were lowered

    def node(self, step: Any, t_ptr: int, ask: bool) -> None:
        from ..subjects.engines.llama_cpp import GGMLTensor

        if not ask or self.done == step.index:
            return
        t = GGMLTensor.from_address(t_ptr)
        if step.lib.ggml_op_name(t.op) != b"ROPE":
            return
        pos = t.src[1]  # the positions operand of ggml_rope_ext
        n = step.lib.ggml_nelements(pos)
        buf = (ctypes.c_int32 * n)()
        step.lib.ggml_backend_tensor_get(pos, buf, 0, ctypes.sizeof(buf))
        for i in range(n):
            buf[i] -= 1
        step.lib.ggml_backend_tensor_set(pos, buf, 0, ctypes.sizeof(buf))
        self.done = step.index


class KVEntryOverwritten:
    """Before the first decode step, the KV cache entry of the prompt's last token (position P-1) is replaced
    by another token's: the cell is removed (llama_memory_seq_rm) and token 0 decoded at that position, so
    its K and V are token 0's there. The prompt's logits (step 1) were computed before; every decode step
    attends to the wrong entry."""

    def before(self, step: Any) -> None:
        if step.index != 1:
            return
        mem = step.L.llama_get_memory(step.ctx)
        if not step.L.llama_memory_seq_rm(mem, 0, step.prompt_len - 1, -1):
            raise RuntimeError("llama_memory_seq_rm refused to remove the cache's last cell")
        step.decode([0], step.prompt_len - 1)


def rope_at_previous_position() -> RopeAtPreviousPosition:
    return RopeAtPreviousPosition()


def kv_entry_overwritten() -> KVEntryOverwritten:
    return KVEntryOverwritten()


@register("decode-rope-previous-position", "engine",
          "llama.cpp's decode steps rotate the new token's q and k at position p-1 (the prefill is right)",
          expect="decode path")
def decode_rope_previous_position(engine: Any) -> Any:
    engine.plant = f"{_HERE}:rope_at_previous_position"
    return engine


@register("decode-kv-overwritten", "engine",
          "llama.cpp's KV cache entry of the prompt's last token holds another token's K and V before decoding",
          expect="decode path")
def decode_kv_overwritten(engine: Any) -> Any:
    engine.plant = f"{_HERE}:kv_entry_overwritten"
    return engine


# ---- transformers: a hook on the model, in this process ------------------------------------------------------

def _cache_position_minus_one(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A forward pre-hook: on a decode step (one new token) cache_position and position_ids are one less."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if ids is not None and ids.shape[-1] == 1:
        for key in ("cache_position", "position_ids"):
            if kwargs.get(key) is not None:
                kwargs[key] = kwargs[key] - 1
    return args, kwargs


@register("decode-cache-position", "engine",
          "transformers' decode steps get cache_position (and position ids) one less than the token's position",
          expect="decode path")
def decode_cache_position(engine: Any) -> Any:
    engine.plant = lambda model: model.register_forward_pre_hook(_cache_position_minus_one, with_kwargs=True)
    return engine
