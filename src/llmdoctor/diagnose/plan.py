"""The elimination plan as data: an ordered table of hypotheses, cheapest first and in stack order (an
earlier layer's fault explains later symptoms), each with its question, what it needs and its check.

A hypothesis runs only when everything it needs is there; otherwise it is "skipped: <why>", the reason
coming from the first missing need. docs/hypotheses.md's table is generated from this table
(`python -m llmdoctor.diagnose.plan`; tests/diagnose/test_diagnose_plan.py holds the two equal).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..checks.base import Finding
from . import hypotheses as h
from .configured import configured_engine, h_configured_ladder, h_configured_requests
from .decode import h_decode_path
from .kv_cache import h_kv_scales
from .session import Session, Skip


def _reason(probe: Callable[[], object]) -> str | None:
    try:
        probe()
    except Skip as e:
        return str(e)
    return None


def _backend_selecting(s: Session) -> str | None:
    from ..subjects.engines import engine_class, selectable

    if s.inputs.engine is not None and engine_class(s.inputs.engine).traits.selects_backends:
        return None
    names = [n for n in selectable() if engine_class(n).traits.selects_backends]
    return f"only --engine {' or '.join(names)} selects attention backends at run time"


# need -> (what it is, in words; why it is missing, or None)
NEEDS: dict[str, tuple[str, Callable[[Session], str | None]]] = {
    "gguf": ("a GGUF file", lambda s: _reason(s.gguf_path)),
    "reference": ("a model the reference reads (a GGUF, or an HF checkpoint)", lambda s: _reason(s.reference_path)),
    "consistent": ("metadata consistent with the tensors", lambda s: _reason(s.require_consistent)),
    "engine": ("an engine that runs this model's format (--engine)", lambda s: _reason(s.engine)),
    "engine-copy": ("the engine's own copy of the file", lambda s: None if s.inputs.engine_gguf is not None
                    and s.inputs.engine is not None else "the engine loads the reference file itself"),
    "dequant-kernel": ("a dequant kernel (--dequant-kernel, or the engine's built-in one)",
                       lambda s: None if s.dequant_kernel() else
                       "no dequant kernel to check (--dequant-kernel, or an engine whose kernel is built in)"),
    "attention-kernel": ("an attention kernel (--attention-impl)", lambda s: None if s.inputs.attention_impl
                         else "no attention kernel given (--attention-impl)"),
    "indexer": ("a sparse-attention indexer in the model (glm-dsa)",
                lambda s: None if (m := s.config().mla) is not None and m.indexer is not None
                else f"{s.config().arch} has no sparse-attention indexer"),
    "moe": ("MoE layers in the model", lambda s: None if s.config().moe is not None
            else f"{s.config().arch} has no MoE layers"),
    "backend-selecting-engine": ("an engine that selects attention backends at run time", _backend_selecting),
    "configured-engine": ("the deployment's own engine command line (--engine vllm --engine-args)",
                          lambda s: _reason(lambda: configured_engine(s))),
    "endpoint": ("a live endpoint (--endpoint)", lambda s: None if s.inputs.endpoint
                 else "no endpoint given (--endpoint)"),
}


@dataclass(frozen=True)
class Hypothesis:
    key: str  # the findings' check name
    title: str  # as the README's table names it
    question: str
    needs: tuple[str, ...]
    run: Callable[[Session], list[Finding]]
    evidence: str  # what it measures, for people (the README's table)

    def missing(self, s: Session) -> str | None:
        """Why this hypothesis cannot run here (the first missing need), or None."""
        for need in self.needs:
            try:
                why = NEEDS[need][1](s)
            except Skip as e:  # asking needed what is missing (a model's config without a model)
                why = str(e)
            if why is not None:
                return why
        return None


PLAN: tuple[Hypothesis, ...] = (
    Hypothesis("file-integrity", "file integrity", "Is the model file intact?", ("gguf",), h.h_file_integrity,
               "the hardened reader, every tensor decoded to finite values, and weight forensics (`check "
               "forensics`): a tensor whose block scales or weight statistics stand out from its role siblings"),
    Hypothesis("engine-file", "engine file", "Does the engine load the same model?", ("gguf", "engine-copy"),
               h.h_engine_file, "when the engine loads another copy: metadata keys and tensor bytes that differ"),
    Hypothesis("metadata", "metadata semantics", "Does the metadata describe the tensors?", ("gguf",), h.h_metadata,
               "`check metadata` (hard faults: the steps that need a consistent model are then skipped, \"the "
               "metadata is inconsistent\"; advisories) and `check frontend` (chat template, vocab, llama.cpp decode "
               "parity on every special and byte token and 4,096 seeded others)"),
    Hypothesis("mapping", "name map / layout", "Are the GGUF<->HF names and layouts right?", ("gguf",), h.h_mapping,
               "`check mapping` (with `--hf DIR` each tensor's numbers too)"),
    Hypothesis("front-end", "engine front end", "Does the deployment tokenize as the model file says?", ("engine",),
               h.h_front_end,
               "the engine's own tokenization (llama.cpp as its server does; transformers and vLLM with the tokenizer "
               "folder they load, `--tokenizer DIR`; an endpoint's tokenize route) of fixed prompts (digits, runs of "
               "spaces, unicode, byte fallback, spelled special tokens) and a chat through its chat template, against "
               "the GGUF's tokenizer and template: the first differing token with both pieces, BOS missing or "
               "doubled, the count ratio; where they differ, the engine's next token on its own tokens and on the "
               "reference's (front end or compute)"),
    Hypothesis("dequant", "dequant kernels", "Is the engine's dequant kernel right?", ("gguf", "dequant-kernel"),
               h.h_dequant, "`check dequant` of `--dequant-kernel`, or of the engine's own kernel (llama.cpp: "
               "libggml's `to_float`), 32 blocks per tensor"),
    Hypothesis("fp16-overflow", "float16 overflow", "Does the model overflow in float16?", ("consistent", "reference"),
               h.h_fp16_overflow, "the float32 reference's max \\|activation\\| per layer against 65504; confirmed "
               "by the reference run in float16 when the deployment runs float16, advisory otherwise"),
    Hypothesis("attention", "attention kernels", "Are the attention kernels right?", ("attention-kernel", "reference"),
               h.h_attention, "`check attention` of `--attention-impl --attention-contract` on this model's "
               "attention shape, in the engine's dtype"),
    Hypothesis("dsa-selection", "DSA key selection",
               "Does the engine's sparse-attention indexer select the reference's keys?", ("indexer", "engine"),
               h.h_dsa_selection,
               "the keys the engine's indexer picks per query (llama.cpp's `top_k` nodes, transformers' indexer "
               "outputs, vLLM's `topk_indices_buffer`) must be among the reference's top k by the reference's own "
               "index scores, ties at the k-th score either way (ReLU scores are often exactly 0), in no more "
               "queries than the emulated run misses (the queries that choose judged apart from those that see at "
               "most top-k keys and must keep them all), and in no more picks scoring below the k-th by more than "
               "the engine's score error than a healthy engine makes at a 1e-3 false-alarm chance (the per-key "
               "count, with power where an FP8 indexer makes exact top-k sets rare); every reference run then "
               "attends to the engine's picks, so a legitimate tie-break is not a divergence"),
    Hypothesis("moe-routing", "MoE routing", "Does the engine route tokens to the reference's experts?",
               ("moe", "engine", "consistent"), h.h_moe_routing,
               "the engine's chosen experts per MoE layer (llama.cpp's `ffn_moe_topk` nodes; transformers' router "
               "outputs; vLLM's `select_experts`) must be a top-k choice the reference's selection scores allow, "
               "within K x the emulated run's largest score error (grouped top-k included: near-tied experts or "
               "groups may go either way); every reference run then takes the engine's experts, so a near-tie "
               "flipped by rounding is neither a routing fault nor a divergence downstream"),
    Hypothesis("engine-backends", "engine backends", "Which attention backends does vLLM select, and did it build them?",
               ("backend-selecting-engine",), h.h_engine_backends,
               "the attention backends the engine's own selection picks for this model, dtype and platform (vLLM: "
               "dense or MLA; decode and prefill) against the ones the running engine built, and what each "
               "`attention_config.backend` setting would pick instead"),
    Hypothesis("engine-finite", "engine finite", "Does the engine compute finite numbers?", ("engine", "consistent"),
               h.h_engine_finite,
               "inf/NaN in the engine's logits or captured activations where the reference is finite, its own "
               "finding in words (\"engine logits NaN at 54 of 54 positions\", the first non-finite capture point; "
               "`checks/compute/finite.py`), never folded into a KL or an error"),
    Hypothesis("kv-scales", "fp8 KV scales", "Do the fp8 KV cache's k/v scales keep K and V inside e4m3's range?",
               ("engine", "consistent"), h_kv_scales,
               "with an fp8 KV cache (vLLM `--kv-cache-dtype fp8`: the scales the loaded model holds, per layer), the "
               "float32 reference's own K (after RoPE) and V of the prompt stored as e4m3(x / scale) the way the engine "
               "rounds: a layer's k_scale or v_scale whose round trip loses more than e4m3's resolution (relative L2 "
               "2^-3 toward zero, 2^-4 to nearest) saturates or zeroes values and is named, with the share clipped or "
               "zeroed and the scale that maps the largest \\|value\\| to 448 (the emulated run uses the same "
               "scales, so engine-vs-reference alone would call the damage noise)"),
    Hypothesis("engine-vs-reference", "engine vs reference", "Does the engine compute the model's distribution?",
               ("engine", "consistent"), h.h_engine_vs_reference,
               "every position's next-token distribution, each criterion against the engine's noise (the emulated "
               "run's): finite logits; mean KL within 3x the emulated run's; a top-1 flip counts only where the "
               "reference's margin between the two tokens exceeds 3x the emulated run's RMS error on a logit "
               "difference at that position (a near tie flipped by rounding is no disagreement); the failing "
               "criterion is named"),
    Hypothesis("decode-path", "decode path", "Does the engine's generation (KV cache, decode kernels) match its prefill?",
               ("engine", "consistent"), h_decode_path,
               "the engine generates `--generate N` tokens greedily (default 16; llama.cpp: `llama_decode` one token at "
               "a time over its KV cache; transformers: `generate` with its cache; vLLM: its scheduler with every "
               "step's logprobs); the reference teacher-forces prompt + that continuation and judges the decode steps "
               "with engine-vs-reference's criteria; the engine's own prefill of the same tokens is the control (a "
               "fault it shows too is the prefill's); the first generated step beyond its noise, and the decode steps' "
               "first divergent layer and op where the engine exposes them"),
    Hypothesis("configured-requests", "configured requests",
               "Does the code the deployment's options turn on compute the model's distribution?",
               ("configured-engine", "consistent"), h_configured_requests,
               "with the deployment's `vllm serve` arguments: a prompt longer than `--max-num-batched-tokens` (so its "
               "prefill runs in chunks; the prompt repeated where it is shorter), judged per position with the flips "
               "grouped by chunk; a second request sharing the first's leading KV blocks and then a block of other "
               "tokens (a prefix-cache hit: vLLM's own count of cached tokens, the generated steps judged, the engine's "
               "uncached prefill of the same tokens the control); each with engine-vs-reference's criteria against its "
               "configuration's noise"),
    Hypothesis("configured-ladder", "configured ladder", "Which option of the deployment's configuration breaks it?",
               ("configured-engine", "consistent"), h_configured_ladder,
               "when the prompt, the generated steps or a configured request disagrees: the engine started again with "
               "one option put back at a time (CUDA graphs off, torch.compile off, KV cache in the model's dtype, "
               "prefix caching off, chunked prefill off, vLLM's own attention backend), in one driver process; the "
               "first whose reversal makes every failing request agree is named, and the fault localized to a layer "
               "and op in a configuration that keeps it (a compiled one captured eagerly with the custom ops' native "
               "forms), or why not"),
    Hypothesis("symptom-bisection", "symptom bisection", "Which symptom class does the endpoint show?", ("endpoint",),
               h.h_symptom_bisection, "`probe` of `--endpoint`"),
    Hypothesis("layer-localization", "layer localization", "Where does the engine leave the reference?",
               ("engine", "consistent"), h.h_layer_localization,
               "the engine's activations layer by layer (llama.cpp: every graph node through `cb_eval`; "
               "transformers: hidden states; vLLM: forward hooks, with q and k after RoPE, so a divergence is named "
               "to its op); then op substitution: the reference rerun with one suspect swapped in; at an op right "
               "after RoPE, the rotary variant (pairing, direction, positions, base, scale) that reproduces the "
               "engine is named as the cause"),
)


def order() -> dict[str, int]:
    """{check name: its place in the plan} (suspects are ranked by it)."""
    return {hyp.key: i for i, hyp in enumerate(PLAN)}


def markdown() -> str:
    """The plan as docs/hypotheses.md's table (markdown)."""
    rows = ["| # | hypothesis | needs | evidence |", "| --- | --- | --- | --- |"]
    rows += [f"| {i} | {hyp.title} | {'; '.join(NEEDS[n][0] for n in hyp.needs)} | {hyp.evidence} |"
             for i, hyp in enumerate(PLAN, 1)]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown())
