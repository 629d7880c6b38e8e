"""Layer localization logic on synthetic curves: healthy noise passes, a fault is found where it starts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmdoctor.checks.compute.layers import error_curve, first_divergent_layer

N_LAYER = 6


def _acts(seed: int, noise: float, fault_from: int | None = None, fault: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    base = torch.Generator().manual_seed(0)
    out = {}
    for il in range(N_LAYER):
        for p in ("attn_norm", "l_out"):
            x = torch.randn(8, 16, generator=base)
            e = noise * torch.randn(8, 16, generator=g) * x.norm() / 11.3
            if fault_from is not None and il >= fault_from:
                e = e + fault * x
            out[f"{p}-{il}"] = x + e
    return out


def test_healthy_engine_not_divergent():
    ref, budget, engine = _acts(0, 0), _acts(1, 1e-3), _acts(2, 1e-3)
    curve = error_curve(ref, budget, engine, N_LAYER)
    assert len(curve) == 2 * N_LAYER
    assert first_divergent_layer(curve) == (None, None)


def test_fault_found_at_its_layer():
    ref, budget, engine = _acts(0, 0), _acts(1, 1e-3), _acts(2, 1e-3, fault_from=3, fault=0.05)
    layer, point = first_divergent_layer(error_curve(ref, budget, engine, N_LAYER))
    assert layer == 3 and point.point == "attn_norm" and point.divergent


def test_one_off_excursion_is_not_the_cause():
    ref, budget, engine = _acts(0, 0), _acts(1, 1e-3), _acts(2, 1e-3)
    engine["l_out-1"] = engine["l_out-1"] * 1.5
    assert first_divergent_layer(error_curve(ref, budget, engine, N_LAYER)) == (None, None)


def test_nan_is_divergent_and_bit_exact_budget_has_a_floor():
    ref = _acts(0, 0)
    engine = dict(ref)
    assert first_divergent_layer(error_curve(ref, ref, engine, N_LAYER)) == (None, None)
    engine["l_out-4"] = engine["l_out-4"] * float("nan")
    engine["attn_norm-5"] = engine["attn_norm-5"] * float("nan")
    assert first_divergent_layer(error_curve(ref, ref, engine, N_LAYER))[0] == 4


def test_llama_cpp_names_are_aliased():
    from llmdoctor.subjects.engines.llama_cpp import to_reference_names

    out = to_reference_names({"sa_out-3": 1, "l_out-3": 2, "result_norm": 3})
    assert out == {"ffn_inp-3": 1, "l_out-3": 2, "result_norm": 3}


def test_blow_up_diverges_even_when_the_budget_blows_up_too():
    ref = _acts(0, 0)
    budget, engine = _acts(1, 1e-3), _acts(2, 1e-3)
    for d in (budget, engine):
        d["attn_norm-2"] = d["attn_norm-2"] * float("inf")
        d["l_out-2"] = d["l_out-2"] * float("inf")
    curve = error_curve(ref, budget, engine, N_LAYER)
    assert [p.layer for p in curve if p.divergent] == [2, 2]
    assert first_divergent_layer(curve) == (None, None)  # layer 2 alone heals in this synthetic case
    engine["attn_norm-3"] = engine["attn_norm-3"] * float("nan")
    assert first_divergent_layer(error_curve(ref, budget, engine, N_LAYER))[0] == 2


def test_selection_disagreement_allows_ties_at_the_kth_score_only():
    import numpy as np

    from llmdoctor.checks.compute.routing import selection_disagreement

    inf = float("-inf")
    scores = np.array([[1.0, inf, inf, inf],       # query 0 sees key 0 only
                       [0.0, 0.0, inf, inf],       # query 1: two keys tied at 0
                       [3.0, 0.0, 0.0, inf],       # query 2: top-2 = key 0 and one of the tied keys 1, 2
                       [3.0, 2.0, 1.0, 0.5]])
    ok = np.array([[0, 3], [1, 0], [0, 2], [0, 1]])   # an invisible pick (3 > 0) is filler, not counted
    assert selection_disagreement(scores, ok, 2) == 0.0
    bad = np.array([[0, 3], [1, 0], [0, 2], [0, 3]])  # query 3 took key 3 (0.5) over key 1 (2.0)
    assert selection_disagreement(scores, bad, 2) == 0.25


def test_selection_disagreement_is_its_definition_row_by_row():
    """The vectorized rule against its definition applied to one row at a time, on random scores with
    ties, masked (future) keys and picks that are duplicated, padded, out of range or masked."""
    from llmdoctor.checks.compute.routing import selection_disagreement

    def by_definition(scores, sel, top_k, rel_tol=1e-5):
        finite = np.where(np.isfinite(scores), scores, -np.inf)
        k = min(top_k, scores.shape[1])
        bad = []
        for t in range(scores.shape[0]):
            row = finite[t]
            visible = int(np.isfinite(row).sum())
            kth = -np.sort(-row)[k - 1]
            tol = rel_tol * np.max(np.abs(np.where(np.isfinite(row), row, 0.0)))
            picks = {int(j) for j in sel[t] if 0 <= j < len(row) and np.isfinite(row[j])}
            if len(picks) != min(k, visible):
                bad.append(True)
                continue
            above = np.nonzero(row > kth + tol)[0]
            bad.append(any(int(j) not in picks for j in above) or any(row[j] < kth - tol for j in picks))
        return float(np.mean(bad))

    rng = np.random.default_rng(0)
    for trial in range(40):
        t_n, s_n, k = rng.integers(1, 12), rng.integers(2, 20), rng.integers(1, 8)
        k = min(k, s_n)
        scores = rng.integers(-3, 4, size=(t_n, s_n)).astype(np.float64)  # many ties
        scores[rng.random((t_n, s_n)) < 0.2] = -np.inf  # masked keys
        sel = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        noise = rng.random(sel.shape) < 0.3
        sel = np.where(noise, rng.integers(-2, s_n + 2, size=sel.shape), sel)  # wrong, padded, out of range
        assert selection_disagreement(scores, sel, int(k)) == by_definition(scores, sel, int(k)), trial


def test_selection_disagreement_catches_short_duplicated_padded_and_future_picks():
    import numpy as np

    from llmdoctor.checks.compute.routing import selection_disagreement

    inf = float("-inf")
    scores = np.array([[1.0, inf, inf, inf], [2.0, 1.0, inf, inf], [3.0, 2.0, 1.0, inf], [3.0, 2.0, 1.0, 0.5]])
    good = np.array([[0, 3], [0, 1], [0, 1], [0, 1]])
    assert selection_disagreement(scores, good, 2) == 0.0
    for wrong in ([[0, 0], [1, 1], [2, 2], [3, 3]],        # duplicates: one key attended to, not two
                  [[0, 9], [0, 9], [0, 9], [0, 9]],        # padding index instead of a second key
                  [[0, 1], [1, 2], [2, 3], [3, 3]]):       # future keys
        assert selection_disagreement(scores, np.array(wrong), 2) > 0.5, wrong
    assert selection_disagreement(scores, np.array([[0], [0], [0], [0]]), 2) == 1.0  # short rows


# ---- the next-token distributions (diagnose's engine-vs-reference) -------------------------------

def _noisy(seed: int, noise: float, base: torch.Tensor) -> torch.Tensor:
    return base + noise * torch.randn(base.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _reference(t: int = 40, v: int = 2000) -> torch.Tensor:
    """Logits [t, v]: token 0 on top, by 0.01 over token 1 at even positions (a near tie) and by 8 at
    odd ones; at position 3 a flat distribution whose top-1 leads by 1 (a flip there costs little KL)."""
    base = 0.3 * torch.randn(t, v, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    base[:, 0] = 12.0
    base[:, 1] = torch.where(torch.arange(t) % 2 == 0, 11.99, 4.0)
    base[3, :2] = torch.tensor([2.0, 1.0], dtype=torch.float64)
    return base


def test_logit_pair_noise_and_top1_margin():
    from llmdoctor.checks.metrics import logit_pair_noise, top1_margin

    want = _reference()
    got = _noisy(1, 0.1, want) + 5.0  # a shift changes no logit difference
    noise = logit_pair_noise(got, want)
    assert torch.allclose(noise, torch.full_like(noise, 0.1 * 2 ** 0.5), rtol=0.1)
    want[:, 7] = float("-inf")  # a token the reference rules out does not count
    assert torch.allclose(logit_pair_noise(got, want), noise, rtol=1e-2)
    got = want.clone()
    got[5, 1] = 13.0  # the engine prefers token 1 where the reference prefers token 0 by 8
    assert top1_margin(got, want).tolist() == [0.0] * 5 + [8.0] + [0.0] * 34
    got[5, 1] = 12.0  # a tie in the engine's logits (its argmax names token 0 or 1 by convention): no flip
    assert top1_margin(got, want).tolist() == [0.0] * 40
    got[5, 0], got[5, 1] = 11.0, 12.0  # token 1 alone on top again
    assert top1_margin(got, want)[5] == 8.0


def _criteria(engine, ref, emu) -> dict:
    from llmdoctor.checks.compute.layers import distribution_criteria

    return {c.name: c for c in distribution_criteria(engine, ref, emu)}


def test_flips_within_the_engines_noise_are_not_disagreements():
    ref = _reference()
    emu, engine = _noisy(1, 0.05, ref), _noisy(2, 0.05, ref)
    engine[0, 1] = engine[0, 0] + 0.02  # a near tie (margin 0.01) flipped: within K x noise (about 0.2)
    crit = _criteria(engine, ref, emu)
    assert all(c.ok for c in crit.values()), crit
    assert crit["top1"].value == 0 and "flips, 0 beyond the engine's noise" in crit["top1"].reason
    assert crit["top1"].evidence and not any(r["beyond_noise"] for r in crit["top1"].evidence)


def test_each_failing_criterion_is_named():
    ref = _reference()
    emu, healthy = _noisy(1, 0.05, ref), _noisy(2, 0.05, ref)
    flip = healthy.clone()
    flip[3, 1] = flip[3, 0] + 1.0  # the engine prefers token 1 by 1 where the reference prefers token 0 by 1
    crit = _criteria(flip, ref, emu)
    assert [n for n, c in crit.items() if not c.ok] == ["top1"], crit  # within the KL budget, yet wrong
    assert "at position 3 the reference prefers its token by 1" in crit["top1"].reason
    assert [r["beyond_noise"] for r in crit["top1"].evidence if r["position"] == 3] == [True]
    nan = healthy.clone()
    nan[5, 9] = float("nan")
    crit = _criteria(nan, ref, emu)
    assert [n for n, c in crit.items() if not c.ok] == ["finite"]  # the rest judge the finite positions
    assert "over 39 finite positions" in crit["kl"].reason and "nan" not in crit["kl"].reason
    assert list(_criteria(torch.full_like(ref, float("nan")), ref, emu)) == ["finite"]
    assert not _criteria(_noisy(3, 0.5, ref), ref, emu)["kl"].ok  # 10x the noise


def test_dsa_rows_judge_the_queries_that_choose_apart_from_the_short_ones():
    """An indexer that keeps the lowest-scoring keys, on a prompt where 48 of 120 queries see at most top-k keys:
    the 72 queries that choose miss where the emulated run (6 near-tie swaps) keeps a top-k set, beyond McNemar's
    allowance; a healthy engine's picks (the reference's own top k) pass both groups, and a short query that
    drops a key it sees fails (its selection is determined)."""
    from llmdoctor.checks.compute.routing import dsa_misses, dsa_rows

    rng = np.random.default_rng(1)
    t_n, k = 120, 48
    scores = rng.standard_normal((t_n, t_n))
    scores[np.triu_indices(t_n, 1)] = -np.inf  # query t sees keys 0..t
    emu = scores.copy()
    order = np.argsort(-scores, axis=1, kind="stable")
    for t in range(k, k + 6):  # the emulated run swaps the k-th and (k+1)-th keys of 6 choosing queries
        a, b = order[t, k - 1], order[t, k]
        emu[t, a], emu[t, b] = scores[t, b], scores[t, a]
    lowest = np.argsort(np.nan_to_num(scores, neginf=np.inf), axis=1, kind="stable")[:, :k]
    (row,) = dsa_rows(1, k, {"indexer_score-0": scores}, {"indexer_score-0": emu}, {"top_k-0": lowest}, 1e-3)
    assert (row["queries"], row["short"]["queries"], row["alone"], row["discordant"]) == (72, 48, 66, 66), row
    assert row["disagreement"] == 1.0 and row["noise"] == pytest.approx(6 / 72), row
    assert dsa_misses(row).startswith("100% of the 72 queries that choose keep no top-k set of the reference's "
                                      "scores (8% under the engine's emulated arithmetic): 66 where"), row
    (healthy,) = dsa_rows(1, k, {"indexer_score-0": scores}, {"indexer_score-0": emu}, {"top_k-0": order[:, :k]},
                          1e-3)
    assert dsa_misses(healthy) == "" and healthy["disagreement"] == 0.0, healthy
    dropped = order[:, :k].copy()
    dropped[10, 0] = -1  # one short query loses a key it sees: no rounding explains that
    (short,) = dsa_rows(1, k, {"indexer_score-0": scores}, {"indexer_score-0": emu}, {"top_k-0": dropped}, 1e-3)
    assert short["short"]["limit"] == 0.0 and "of the 48 queries that see at most top-k keys drop" in dsa_misses(short)


def test_excess_misses_is_mcnemars_exact_test():
    """The allowance of a group's misses: of d discordant queries the engine may miss alone in the count whose
    Binomial(d, 1/2) tail stays at the level (20 at 1e-3: 17, P(X > 17) = 2.0e-4, P(X > 16) = 1.3e-3). Measured on
    5,000 healthy pairs whose queries each flip with their own chance (0 to 0.6): alarms at a level of 0.01
    stay below it."""
    from llmdoctor.checks.compute.routing import excess_misses

    eng = np.array([True] * 20 + [False] * 5)
    got = excess_misses(eng, ~eng & (np.arange(25) >= 20), 1e-3)
    assert (got["discordant"], got["alone"], got["allowed"]) == (25, 20, 20), got
    got = excess_misses(eng, np.zeros(25, dtype=bool), 1e-3)
    assert (got["discordant"], got["allowed"], got["limit"]) == (20, 17, pytest.approx(17 / 25)), got
    assert got["disagreement"] > got["limit"]
    rng = np.random.default_rng(0)
    alarms = 0
    for _ in range(5000):
        p = rng.uniform(0, 0.6, 60)  # [n] each query's own chance of a flip
        r = excess_misses(rng.random(60) < p, rng.random(60) < p, 0.01)
        alarms += r["disagreement"] > r["limit"]
    assert alarms / 5000 < 0.01, alarms
