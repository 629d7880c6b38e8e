"""The decode path (issue 25 part 2): every engine generates greedily through its own decode path, the reference
teacher-forces prompt + that continuation and the engine's prefill of the same tokens is the control. The healthy
demo passes; planted decode faults (faults/decode.py) are found as "decode path" with the first generated step;
a prefill fault is not reported twice. Real engines on CPU: llama.cpp, transformers, vLLM for CPU (one test)."""

from __future__ import annotations

import numpy as np
import pytest

from llmdoctor import diagnose as dg
from llmdoctor.diagnose.decode import h_decode_path
from llmdoctor.faults import get

pytestmark = pytest.mark.slow

PROMPT = "Paris is the capital of France, and Berlin is the capital of"  # 14 tokens: short keeps the tests cheap
N = 8


def decode_finding(gguf, engine: str = "llama.cpp", plant: str | None = None, **kw):
    s = dg.Session(dg.Inputs(gguf=gguf, engine=engine, threads=2, prompt=PROMPT, generate=N,
                             engine_plant=None if plant is None else get(plant).build, **kw))
    try:
        return h_decode_path(s)[0], s.tokens()
    finally:
        s.close()


def test_llama_cpp_generates_greedily_what_its_prefill_computes(demo_path):
    """llama.cpp's generation: N ids, each the argmax of its step's logits [N, V]; its own prefill of prompt +
    continuation picks the same tokens; the decode steps' captures come back one row per step, only when
    asked (capturing slows every step)."""
    from llmdoctor.subjects.engines import create
    from llmdoctor.subjects.engines.base import Deployment

    tokens = [2, 9079, 563, 506, 5279, 529]
    engine = create("llama.cpp", Deployment(model=demo_path, threads=2))
    gen = engine.generate(tokens, 4)
    assert len(gen.ids) == 4 and gen.logits.shape[0] == 4 and not gen.captures
    assert gen.ids == [int(r.argmax()) for r in gen.logits]
    assert gen.info.details["kv_cache_type"] == "f16/f16"
    ran = engine.run(tokens + gen.ids[:-1])
    assert [int(r.argmax()) for r in ran.logits[len(tokens) - 1:]] == gen.ids
    again = engine.generate(tokens, 4, captures=True)
    assert again.ids == gen.ids and np.array_equal(again.logits, gen.logits)  # capturing changes no number
    assert again.captures["l_out-0"].shape == (3, 640) and again.captures["kqv_out-17"].shape[0] == 3


def test_healthy_demo_decode_path_passes(demo_path):
    f, tokens = decode_finding(demo_path)
    assert f.status == "pass", f.explanation
    assert f.metrics["generated"] == N and f.metrics["first_wrong_step"] is None
    assert "decode steps within the engine's noise" in f.explanation and "prefill of the same tokens" in f.explanation
    assert f.metrics["engine"]["kv_cache_type"] == "f16/f16"
    pts = f.metrics["decode_points"]  # the decode steps' activations judged too: 18 layers x 5 graph nodes
    assert pts["points"] == 90 and pts["first_divergent_layer"] is None and pts["worst_ratio"] < 1, pts
    assert "their activations within it at 90 points" in f.explanation


def test_planted_llama_cpp_decode_fault_is_the_decode_path(demo_path):
    """A KV cache entry holding another token's K/V: the prefill control agrees, the decode steps do not (step 2's
    KL 0.080 where the 16 draws' at that position is 0.0014: beyond its per-position allowance); the finding names
    the first generated step and the decode steps' first divergent layer and op (captured from a second generation
    of the same tokens)."""
    f, tokens = decode_finding(demo_path, plant="decode-kv-overwritten")
    assert f.status == "fail", f.explanation
    assert f.explanation.startswith("decode path: first wrong at generated step 2")
    assert "prefill of the same tokens agrees" in f.explanation
    assert f.metrics["first_wrong_step"] == 2  # step 1 comes out of the prompt's prefill
    assert f"position {len(tokens)}" in f.explanation
    loc = f.metrics["localization"]
    assert loc.get("layer") is not None and loc["point"] in ("kqv_out", "ffn_inp", "l_out", "ffn_out"), loc
    assert f"first divergent layer {loc['layer']}" in f.explanation


def test_activations_that_could_not_be_judged_are_said_not_passed(demo_path, monkeypatch):
    """Where the decode steps' activations were to be judged and could not be (here: the captured generation took
    other tokens), the passing finding says so in its words and its metrics, never as a silent pass."""
    import llmdoctor.diagnose.decode as decode
    from llmdoctor.diagnose.session import Skip

    def other_tokens(*a, **kw):
        raise Skip("the engine generated other tokens when its decode steps were captured")

    monkeypatch.setattr(decode, "decode_points", other_tokens)
    f, _ = decode_finding(demo_path)
    assert f.status == "pass", f.explanation
    assert f.explanation.endswith("; their activations not judged: the engine generated other tokens when its decode "
                                  "steps were captured"), f.explanation
    assert f.metrics["decode_points"] == {"skipped": "the engine generated other tokens when its decode steps were "
                                                     "captured"}


def test_a_rope_fault_one_position_off_is_found_in_the_decode_steps_activations(demo_path):
    """Decode steps rotated at p-1 (faults/decode.py) raise the 7 decode steps' mean KL on the demo to 0.0159, about
    twice the randomized draws' (stochastic rounding, standing for another machine's healthy engine): within what the
    draws allow the distributions (0.29 of the allowance). Their activations show it: kqv_out-2 is off by 0.30 (rel.
    L2) where the draws' RMS error there is 0.048, 2.1x the allowance set for the whole diagnosis (checks/compute/
    decode.py `judge_points`), from the first decode step on, while the engine's prefill of the same tokens stays
    within the noise."""
    f, tokens = decode_finding(demo_path, plant="decode-rope-previous-position")
    kl = next(c for c in f.evidence[0]["decode"] if c["criterion"] == "kl")
    assert kl["ok"] and kl["value"] > 1.5 * kl["noise"], kl  # the distributions: the effect there, within noise
    assert f.status == "fail", f.explanation
    assert f.explanation.startswith("decode path: first wrong at generated step 2"), f.explanation
    assert "the decode steps' activations leave the reference" in f.explanation
    assert "next-token distributions stay within the noise" in f.explanation
    pts, loc = f.metrics["decode_points"], f.metrics["localization"]
    assert pts["first_divergent_layer"] == loc["layer"] and pts["control_first_divergent_layer"] is None
    assert loc["point"] == "kqv_out" and loc["ratio"] > 1.5, loc  # in the attention, well beyond its allowance
    assert f.metrics["first_wrong_step"] == 2 and f"position {len(tokens)}" in f.explanation


def test_a_prefill_fault_is_not_reported_as_the_decode_path(demo_path, tmp_path):
    """The engine's copy of the file has blk.7.attn_output's scales perturbed: the prefill already disagrees
    (engine-vs-reference says so); the decode path is a skip with that reason, never a second suspect."""
    from llmdoctor.diagnose.session import Skip

    bad = get("attn-block-scales").build(demo_path, tmp_path, layers="blk.7.attn_output")
    with pytest.raises(Skip, match="prefill of the prompt already disagrees"):
        decode_finding(demo_path, engine_gguf=bad)


def test_generate_zero_turns_it_off(demo_path):
    from llmdoctor.diagnose.session import Skip

    s = dg.Session(dg.Inputs(gguf=demo_path, engine="llama.cpp", generate=0))
    with pytest.raises(Skip, match="--generate 0"):
        h_decode_path(s)


@pytest.mark.parametrize("plant", [None, "decode-cache-position"])
def test_transformers_decode_path(demo_path, plant):
    """transformers generates with `generate` and its DynamicCache: healthy, it passes; with cache_position one
    less on its decode steps (faults/decode.py) its prefill control still agrees and the decode path is named,
    down to the first divergent layer of the decode steps' hidden states."""
    f, tokens = decode_finding(demo_path, engine="transformers", plant=plant)
    if plant is None:
        assert f.status == "pass", f.explanation
        assert f.metrics["engine"]["cache"] == "DynamicCache"
        assert f.metrics["decode_points"]["first_divergent_layer"] is None  # each layer's output, judged
        return
    assert f.status == "fail", f.explanation
    assert f.explanation.startswith("decode path: first wrong at generated step")
    assert f.metrics["first_wrong_step"] >= 2 and "prefill of the same tokens agrees" in f.explanation
    assert f.metrics["localization"].get("layer") is not None, f.metrics["localization"]


def test_vllm_decode_path_through_its_scheduler(tmp_path, vllm_python):
    """vLLM for CPU generates through its scheduler with every step's full-vocabulary logprobs (the driver's
    `generate`); a tiny llama checkpoint on token ids: the decode path passes, the ids are the argmax of each
    step's logprobs, and vLLM's own prefill of the same tokens is the control (one vLLM test: each engine call
    starts vLLM)."""
    from test_engine_vllm import TOKENS, vllm_checkpoint

    ckpt, _ = vllm_checkpoint("llama", tmp_path / "llama")
    s = dg.Session(dg.Inputs(hf=ckpt, engine="vllm", engine_python=vllm_python, threads=2, generate=N,
                             token_ids=list(TOKENS)))
    try:
        f = h_decode_path(s)[0]
        gen = s.generation()
    finally:
        s.close()
    assert gen.ids == [int(r.argmax()) for r in gen.logits] and gen.logits.shape[0] == N
    assert gen.info.details["scheduler"] == "vllm.LLM.generate"
    assert f.status == "pass", f.explanation
    assert f.metrics["generated"] == N and "prefill of the same tokens agrees" in f.explanation


def test_a_dsa_model_whose_decode_picks_are_hidden_is_not_judged(tmp_path):
    """transformers' GLM-DSA on a tiny random model: its decode steps differ from its own prefill of the same
    tokens (KL ~0.1 from step 2, the prefill agrees with the reference to 1e-13) where many index scores are
    exact ReLU zeros. Its indexer's decode-step picks are not exposed, so a legitimate tie-break cannot be told
    from a fault: skipped with the numbers, never a fault (it was one)."""
    import fixtures_hf

    _, gguf_path = fixtures_hf.checkpoint("glm", tmp_path)
    res = dg.run(dg.Inputs(gguf=gguf_path, engine="transformers", token_ids=list(range(3, 27)), threads=2))
    (f,) = [f for f in res.findings if f.check == "decode-path"]
    assert f.status == "skip" and "cannot be told from a legitimate tie-break" in f.reason, f.reason
    assert res.exit_code == 0, res.verdict
