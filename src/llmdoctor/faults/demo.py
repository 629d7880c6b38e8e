"""Deliberately broken demo deployments for `llmdoctor diagnose --demo-fault NAME`.

Each entry turns the healthy demo deployment (the demo GGUF in an engine) into a broken one by
reusing a fault of this registry — a corrupted copy of the file for the engine, a faulty kernel, a
wrong engine precision — and says what the diagnosis must name (`expect`: the check of the
top-ranked suspect, and the layer where the fault is a layer). The tests diagnose every entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import Fault, all_faults, get, register


@dataclass(frozen=True)
class Expect:
    check: str  # the check of the top-ranked suspect
    says: str  # a substring of its explanation
    layer: int | None = None  # the first divergent layer, when the fault is a layer
    swap: str | None = None  # the op substitution that alone reproduces the divergence


def _demo(name: str, description: str, expect: Expect):
    return register(name, "demo", description, expect)  # type: ignore[arg-type]


@_demo("layer7-attn-scales", "the engine's copy of the model has blk.7.attn_output's block scales perturbed",
       Expect("engine-file", "blk.7.attn_output", 7))
def layer7_attn_scales(inputs, tmp: Path) -> None:
    inputs.engine = "llama.cpp"
    inputs.engine_gguf = get("attn-block-scales").build(inputs.gguf, tmp, layers="blk.7.attn_output")


@_demo("engine-rope-base", "the engine's copy of the model has rope.freq_base 100 instead of 1e6",
       Expect("engine-file", "rope.freq_base", 5))
def engine_rope_base(inputs, tmp: Path) -> None:
    inputs.engine = "llama.cpp"
    inputs.engine_gguf = get("rope-base").build(inputs.gguf, tmp)


@_demo("fp16-overflow", "the seed's root cause in miniature: the model run in float16 by transformers",
       Expect("fp16-overflow", "bfloat16", 7, swap="float16 precision"))
def fp16_overflow(inputs, tmp: Path) -> None:
    inputs.engine = "transformers"
    inputs.engine_dtype = "float16"


@_demo("dequant-scale-min-swap", "the deployment's Q4_K dequant kernel exchanges sub-block scale and min",
       Expect("dequant", "scale and min swapped"))
def dequant_scale_min_swap(inputs, tmp: Path) -> None:
    inputs.dequant_kernel = get("scale_min_swap").build()


@_demo("engine-dequant-scale-min-swap",
       "transformers serves the demo GGUF through a Q4_K dequant kernel that swaps sub-block scale and min",
       Expect("dequant", "scale and min swapped", 0, swap="dequant kernel"))
def engine_dequant_scale_min_swap(inputs, tmp: Path) -> None:
    inputs.engine = "transformers"
    inputs.dequant_kernel = get("scale_min_swap").build()


@_demo("attention-top-left", "the deployment's prefill attention kernel aligns the causal mask top-left "
       "(SDPA's is_causal) instead of bottom-right", Expect("attention", "top-left causal alignment"))
def attention_top_left(inputs, tmp: Path) -> None:
    kernel = get("attn-top-left").build()
    inputs.attention_impl, inputs.attention_contract = kernel["impl"], kernel["contract"]


def all_demo_faults() -> list[Fault]:
    return all_faults("demo")


def apply(name: str, inputs, tmp: Path) -> Fault:
    """Break `inputs` (a diagnose.Inputs for the demo model) the way demo fault `name` says."""
    from ..errors import InputError

    f = next((f for f in all_demo_faults() if f.name == name), None)
    if f is None:
        raise InputError(f"unknown demo fault {name!r}; `llmdoctor diagnose --demo-fault list` lists them")
    f.build(inputs, tmp)
    return f
