"""The MLA / glm-dsa reference forward pass against transformers, both in float64.

The float64 bound. Both sides compute the same network in float64 in different operation orders, so
their logits differ by rounding only. To first order each rounding perturbs a value by a relative u =
2^-53, and a chain of N sequential roundings by at most N u (Higham's gamma_N for a reduction of
length N). Such a relative perturbation reaches the logits amplified by the network's sensitivity,
which we measure instead of guessing: perturb every token embedding element by a random relative
+-delta (delta = 1e-9) and read the largest logit change, S = max|d logits| / delta. Bound:
    |ours - transformers| <= 2 * N * u * S
(2: both sides round), with N the longest chain of roundings from embedding to logit: per layer the
lengths of the reductions along the path (norms, projections, scores over R + Dr, softmax and values
over T, v_b, output, router and FFN), plus the final norm and output projection (`chain_length`).

Ties in the DSA selection: index scores are sums of ReLU'd products, so many are exactly 0 (and
torch.topk picks among equal scores in an implementation-defined way). The selections are compared as
sets up to ties (every key chosen by one side only must score within rounding of the k-th best), then
transformers is run with our selection so the logits compare on the same sparse pattern.
"""

from __future__ import annotations

import math

import pytest
import torch

import fixtures_mla as fx
from llmdoctor.faults import get as get_fault
from llmdoctor.reference import from_hf, load
from llmdoctor.gguf.layout import kv_b_split
from llmdoctor.reference import mla
from llmdoctor.reference.arch_deepseek import DSA_OVERRIDE, MoE, route

U = 2.0**-53
T = 40  # prompt length: longer than the indexer's top-k (6), so the sparse selection matters
IDS = torch.randint(0, fx.COMMON["vocab_size"], (T,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return fx.build("deepseek", tmp_path_factory.mktemp("deepseek"))


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return fx.build("glm", tmp_path_factory.mktemp("glm"))


def chain_length(cfg, t: int) -> int:
    """Longest chain of sequential float roundings from an embedding to a logit (see module doc)."""
    m, moe = cfg.mla, cfg.moe
    q_path = cfg.n_embd + 2 * m.q_lora_rank if m.q_lora_rank else cfg.n_embd
    attn_path = q_path + m.qk_nope + (m.kv_lora_rank + m.qk_rope) + 2 * t + m.kv_lora_rank + cfg.n_head * m.v_dim
    ffn_path = cfg.n_embd + max(cfg.n_ff, moe.n_ff_exp if moe else 0)
    return cfg.n_layer * (2 * cfg.n_embd + attn_path + ffn_path) + 2 * cfg.n_embd


class _PerturbedEmbeddings:
    """Weights whose token embeddings are multiplied element-wise by (1 + delta * random sign)."""

    def __init__(self, inner, delta: float):
        self._inner, self.delta = inner, delta

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def rows(self, name, ids):
        x = self._inner.rows(name, ids)
        sign = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(3)).to(x.dtype) * 2 - 1
        return x * (1 + self.delta * sign)


def float64_bound(path, ids, overrides=None) -> tuple[float, torch.Tensor, dict]:
    """(bound, our logits, captures) for the file at `path` (module docstring)."""
    model = load(path, dtype=torch.float64)
    extra = {DSA_OVERRIDE: overrides} if overrides else {}
    logits, cap = _forward(model, ids, extra)
    delta = 1e-9
    model.weights = _PerturbedEmbeddings(model.weights, delta)
    moved, _ = _forward(model, ids, extra)
    sensitivity = float((moved - logits).abs().max()) / delta
    return 2 * chain_length(model.config, len(ids)) * U * sensitivity, logits, cap


def _forward(model, ids, extra):
    """Our forward with optional per-run Step.extra entries (the DSA selection override)."""
    return model.forward(ids, capture={"top_k-*", "indexer_score-*"}, extra=extra)


def hf_logits(fixture, ids, indices: dict[int, torch.Tensor] | None = None, record: dict | None = None):
    """transformers' float64 logits; with `indices`, its DSA indexers return those selections;
    with `record`, the indexers' own selections are stored there by layer."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm

    orig = glm.GlmMoeDsaIndexer.forward

    def forward(self, *a, **k):
        out = orig(self, *a, **k)
        if record is not None:
            record[self.layer_idx] = out[0].long()
        if indices is not None:
            out = indices[self.layer_idx][None].to(out.dtype)
        return out

    glm.GlmMoeDsaIndexer.forward = forward
    try:
        with fx.float64_mode(), torch.no_grad():
            return fixture.model(ids[None]).logits[0]
    finally:
        glm.GlmMoeDsaIndexer.forward = orig


# ---- pure functions -----------------------------------------------------------------------------

def test_naive_and_absorbed_mla_agree():
    g = torch.Generator().manual_seed(0)
    t, h, r, dn, dr, dv = 9, 3, 16, 12, 8, 10
    r64 = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    q_nope, q_pe, latent, k_pe = r64(t, h, dn), r64(t, h, dr), r64(t, r), r64(t, dr)
    k_b, v_b = r64(h, r, dn), r64(h, dv, r)
    allowed = torch.rand(t, t, generator=g) < 0.7
    allowed |= torch.eye(t, dtype=torch.bool)
    allowed &= torch.ones(t, t, dtype=torch.bool).tril()
    a = mla.mla_naive(q_nope, q_pe, latent, k_pe, k_b, v_b, allowed, scale=0.3)
    b = mla.mla_absorbed(q_nope, q_pe, latent, k_pe, k_b, v_b, allowed, scale=0.3)
    assert a.shape == (t, h, dv)
    assert float((a - b).abs().max()) < 1e-12 * float(a.abs().max())


def test_kv_b_split_matches_hf_expand(deepseek):
    """k_b/v_b from the legacy unsplit kv_b decompress the latent as transformers' kv_b_proj does."""
    c = fx.COMMON
    attn = deepseek.model.model.layers[0].self_attn
    latent = torch.randn(5, c["kv_lora_rank"], dtype=torch.float64)
    kv = attn.kv_b_proj(latent).view(5, c["num_attention_heads"], -1)  # [S, H, Dn+Dv]
    k_b, v_b = kv_b_split(attn.kv_b_proj.weight, c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"])
    k_nope, v = mla.decompress(latent, k_b, v_b)
    torch.testing.assert_close(k_nope, kv[..., :c["qk_nope_head_dim"]], rtol=0, atol=1e-13)
    torch.testing.assert_close(v, kv[..., c["qk_nope_head_dim"]:], rtol=0, atol=1e-13)


def test_yarn_matches_transformers(deepseek):
    """Our YaRN frequencies, cos/sin factor and softmax scale equal transformers' (float64)."""
    rot = deepseek.model.model.rotary_emb
    cfg = from_hf(deepseek.config)
    m = cfg.mla
    inv = cfg.rope_base ** (-torch.arange(0, m.qk_rope, 2, dtype=torch.float64) / m.qk_rope)
    ours = inv / mla.yarn_freq_factors(m.qk_rope, cfg.rope_base, m.yarn)
    torch.testing.assert_close(ours, rot.inv_freq.to(torch.float64), rtol=1e-15, atol=0)
    assert not torch.allclose(ours, inv)  # the ramp is inside the 4 frequencies: YaRN does something
    assert m.yarn.attn_factor == pytest.approx(rot.attention_scaling, rel=1e-15)
    assert cfg.attn_scale == pytest.approx(deepseek.model.model.layers[0].self_attn.scaling, rel=1e-15)


def test_route_matches_transformers_router(deepseek):
    router = deepseek.model.model.layers[1].mlp.gate
    x = torch.randn(64, fx.COMMON["hidden_size"], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with fx.float64_mode(), torch.no_grad():
        logits, w_hf, idx_hf = router(x)
    moe = from_hf(deepseek.config).moe
    w, idx, _ = route(logits, router.e_score_correction_bias, moe)
    order_hf, order = idx_hf.sort(-1), idx.sort(-1)
    assert torch.equal(order_hf.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_hf.gather(1, order_hf.indices), rtol=1e-14, atol=0)


def test_route_softmax_grouped():
    """Softmax gating (DeepSeek-V2), grouped top-k, normalization and scaling by hand."""
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.9, 0.5, 0.4]], dtype=torch.float64)
    moe = MoE(n_expert=6, n_used=2, n_shared=0, n_ff_exp=1, gating="softmax", norm_topk=False, scale=2.0,
              n_group=3, topk_group=2)
    w, idx, _ = route(logits, None, moe)
    p = torch.softmax(logits, -1)[0]
    # groups {0,1}, {2,3}, {4,5}: top-2 sums pick groups 0 and 1; then experts 1 and 3
    assert sorted(idx[0].tolist()) == [1, 3]
    torch.testing.assert_close(w[0].sort().values, (2 * p[[3, 1]]).sort().values)
    w, _, _ = route(logits, None, MoE(**{**moe.__dict__, "norm_topk": True}))
    assert float(w.sum()) == pytest.approx(2.0)


@pytest.mark.parametrize("kind", ["deepseek", "glm"])
def test_config_gguf_equals_hf(kind, request):
    """The config read from the GGUF metadata equals the one read from config.json."""
    f = request.getfixturevalue(kind)
    with load(f.gguf_path) as model:
        gguf_cfg = model.config
    hf_cfg = from_hf(f.config)
    diff = gguf_cfg.diff(hf_cfg)  # floats to 1e-6 relative: the file stores float32
    assert diff == {}, diff
    if kind == "glm":
        assert gguf_cfg.mla.indexer.full == (True, False, True)


# ---- whole model vs transformers, float64 ---------------------------------------------------------

def test_deepseek_logits_match_transformers(deepseek):
    bound, ours, _ = float64_bound(deepseek.gguf_path, IDS)
    theirs = hf_logits(deepseek, IDS)
    err = float((ours - theirs).abs().max())
    print(f"deepseek2 float64: max|ours - transformers| = {err:.3g}, bound {bound:.3g}")
    assert err <= bound
    assert bound < 1e-9  # the bound itself is float64-sized, not a loose tolerance


def test_plain_q_lite_model_matches_transformers(tmp_path):
    """DeepSeek-V2-Lite style: no q_lora_rank, a plain wq (GGUF attn_q), no YaRN."""
    f = fx.build("deepseek", tmp_path, q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    bound, ours, _ = float64_bound(f.gguf_path, IDS)
    err = float((ours - hf_logits(f, IDS)).abs().max())
    print(f"deepseek2 lite float64: max|ours - transformers| = {err:.3g}, bound {bound:.3g}")
    assert err <= bound


def test_deepseek_v2_softmax_router_matches_transformers(tmp_path):
    """DeepSeek-V2: softmax gating, greedy top-k, no normalization, no correction bias."""
    f = fx.build("deepseek_v2", tmp_path)
    bound, ours, _ = float64_bound(f.gguf_path, IDS)
    err = float((ours - hf_logits(f, IDS)).abs().max())
    print(f"deepseek2 (V2, softmax) float64: max|ours - transformers| = {err:.3g}, bound {bound:.3g}")
    assert err <= bound


def test_legacy_unsplit_kv_b_file_matches_transformers(tmp_path):
    """A file converted before llama.cpp's MLA split (one attn_kv_b, MHA sizes) runs the same network."""
    f = fx.build("deepseek", tmp_path, legacy=True)
    from llmdoctor.gguf import open_gguf

    assert any(t.name == "blk.0.attn_kv_b.weight" for t in open_gguf(f.gguf_path).tensors)
    bound, ours, _ = float64_bound(f.gguf_path, IDS)
    err = float((ours - hf_logits(f, IDS)).abs().max())
    print(f"deepseek2 legacy kv_b float64: max|ours - transformers| = {err:.3g}, bound {bound:.3g}")
    assert err <= bound


def test_lower_precisions(deepseek):
    """float32 agrees with float64 within the same bound at float32's unit roundoff (2^-24; the
    sensitivity is the float64 one); bfloat16 and float16 run and stay finite."""
    bound64, ref, _ = float64_bound(deepseek.gguf_path, IDS)
    bound32 = bound64 * 2.0**29  # u32 / u64
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with load(deepseek.gguf_path, dtype=dtype) as model:
            out, _ = model.forward(IDS)
            assert out.dtype == dtype and bool(torch.isfinite(out).all())
            assert all(s.n_inf == s.n_nan == 0 for s in model.stats)
        if dtype == torch.float32:
            assert float((out.double() - ref).abs().max()) <= bound32


@pytest.mark.gpu
def test_cuda_matches_cpu(glm):
    """The same float64 forward on CUDA (cuBLAS reduction order) agrees with the CPU one."""
    bound, cpu, _ = float64_bound(glm.gguf_path, IDS)
    with load(glm.gguf_path, dtype=torch.float64, device="cuda") as model:
        gpu, _ = model.forward(IDS)
    assert float((gpu.cpu() - cpu).abs().max()) <= bound


def same_selection_up_to_ties(ours: torch.Tensor, theirs: torch.Tensor, score: torch.Tensor, top_k: int,
                               tol: float) -> tuple[int, int]:
    """Assert that two top-k selections [T, k] agree on the visible (causal) keys up to ties of `score`
    [T, S]: every key chosen by one side only scores within `tol` of the k-th best. Returns
    (keys chosen differently, queries whose k-th and (k+1)-th best scores tie exactly)."""
    differ = boundary_ties = 0
    for t in range(score.shape[0]):
        a = {int(s) for s in ours[t] if s <= t}
        b = {int(s) for s in theirs[t] if s <= t}
        if t < top_k:  # every visible key is selected
            assert a == b == set(range(t + 1)), t
            continue
        best = score[t, :t + 1].topk(top_k + 1).values
        boundary_ties += int(best[-1] == best[-2])
        for s in a ^ b:
            assert abs(float(score[t, s] - best[-2])) <= tol, (t, s)
        differ += len(a ^ b) // 2
    return differ, boundary_ties


def test_selection_comparison_accepts_ties_only():
    score = torch.tensor([[0.0, -1, -1], [3.0, 0, 0], [3.0, 0, 0]]).masked_fill(
        ~torch.ones(3, 3, dtype=torch.bool).tril(), float("-inf"))
    a = torch.tensor([[0, 1], [0, 1], [0, 1]])
    b = torch.tensor([[0, 2], [0, 1], [0, 2]])  # query 2: key 2 instead of the tied key 1
    assert same_selection_up_to_ties(a, b, score, 2, tol=0.0) == (1, 1)
    score[2, 2] = -0.5  # no longer a tie: choosing key 2 is wrong
    with pytest.raises(AssertionError):
        same_selection_up_to_ties(a, b, score, 2, tol=0.0)


def test_glm_dsa_selection_and_logits_match_transformers(glm):
    ix = from_hf(glm.config).mla.indexer
    hf_sel: dict[int, torch.Tensor] = {}
    hf_logits(glm, IDS, record=hf_sel)
    assert sorted(hf_sel) == [il for il, full in enumerate(ix.full) if full]
    # transformers' selections fed to ours: every layer sees the hidden states transformers' did (a tie broken
    # the other way in one layer would change every later layer's scores), and our indexer's own choice
    # from its scores there is compared with transformers' up to ties
    overrides = {il: hf_sel[il] for il in hf_sel}
    bound, ours, cap = float64_bound(glm.gguf_path, IDS, overrides)
    differ = ties = 0
    for il in hf_sel:
        score = cap[f"indexer_score-{il}"]
        mine = mla.topk_indices(score, ix.top_k)
        assert mine.shape == hf_sel[il].shape == (T, ix.top_k)
        # rounding of one index score: H_idx dot products of length D_idx and their weighted sum, both sides
        tol = 2 * (ix.head_dim + ix.n_head) * U * float(score[torch.isfinite(score)].abs().max())
        d, t = same_selection_up_to_ties(mine, hf_sel[il], score, ix.top_k, tol)
        differ, ties = differ + d, ties + t
    # the same selection fed to both sides: the logits agree to float64 rounding
    for il, full in enumerate(ix.full):
        src = il if full else max(j for j in range(il) if ix.full[j])
        assert torch.equal(cap[f"top_k-{il}"], hf_sel[src])  # shared layers reuse the last full one
    theirs = hf_logits(glm, IDS, indices=overrides)
    err = float((ours - theirs).abs().max())
    print(f"glm-dsa float64: max|ours - transformers| = {err:.3g}, bound {bound:.3g}; "
          f"queries with a tie at the top-k boundary {ties}, keys chosen differently {differ}")
    assert err <= bound
    assert bound < 1e-9


def test_dsa_selection_matters(glm):
    """The sparse selection changes the result: a dense run (top_k >= T) gives other logits."""
    with load(glm.gguf_path, dtype=torch.float64) as model:
        sparse, _ = model.forward(IDS)
        ix = model.config.mla.indexer
        model.config.mla = mla.MLA(**{**model.config.mla.__dict__, "indexer": mla.Indexer(**{**ix.__dict__, "top_k": T})})
        dense, _ = model.forward(IDS)
    assert float((sparse - dense).abs().max()) > 1e-3


# ---- planted faults ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fault", ["reference-wrong-rope-base", "reference-missing-norm-offset",
                                   "reference-mla-kv-b-swapped"])
def test_planted_fault_moves_logits_beyond_bound(fault, deepseek):
    planted = get_fault(fault)
    bound, good, _ = float64_bound(deepseek.gguf_path, IDS)
    with load(deepseek.gguf_path, dtype=torch.float64) as model:
        bad, _ = planted.build(model).forward(IDS)
    moved = float((bad - good).abs().max())
    print(f"{fault}: logits moved by {moved:.3g} (bound {bound:.3g})")
    assert moved > 1e6 * bound
    assert math.isfinite(moved)


def test_kv_b_swap_needs_equal_dims(tmp_path):
    """The swap is only a loadable fault when qk_nope_head_dim == v_head_dim (the fault says so)."""
    f = fx.build("deepseek", tmp_path, v_head_dim=8)
    with load(f.gguf_path) as model, pytest.raises(ValueError, match="qk_nope_head_dim == v_head_dim"):
        get_fault("reference-mla-kv-b-swapped").build(model)


def test_fixture_written_like_the_converter(deepseek, glm):
    """Spot checks of the converter's layout in the fixture files: split kv_b, MQA head count, indexer."""
    from llmdoctor.gguf import open_gguf

    c = fx.COMMON
    g = open_gguf(deepseek.gguf_path)
    names = {t.name: t for t in g.tensors}
    assert "blk.0.attn_kv_b.weight" not in names
    assert names["blk.0.attn_k_b.weight"].ne == (c["qk_nope_head_dim"], c["kv_lora_rank"], c["num_attention_heads"])
    assert names["blk.0.attn_v_b.weight"].ne == (c["kv_lora_rank"], c["v_head_dim"], c["num_attention_heads"])
    assert names["blk.1.ffn_gate_exps.weight"].ne == (c["hidden_size"], c["moe_intermediate_size"], c["n_routed_experts"])
    assert g.get("deepseek2.attention.head_count_kv") == 1
    assert g.get("deepseek2.rope.scaling.yarn_log_multiplier") == pytest.approx(0.1)
    g = open_gguf(glm.gguf_path)
    names = {t.name for t in g.tensors}
    assert {"blk.0.indexer.attn_q_b.weight", "blk.0.indexer.k_norm.bias", "blk.2.indexer.proj.weight"} <= names
    assert not any(n.startswith("blk.1.indexer") for n in names)  # the shared layer has no indexer
    assert list(g.get("glm-dsa.attention.indexer.types")) == [1, 0, 1]
