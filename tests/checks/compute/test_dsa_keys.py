"""checks/compute/routing.py's per-key DSA statistic (issue 35 item 1): a pick whose reference score falls below
the k-th by more than the engine's score error is wrong; their count is judged against an allowance derived for
the whole family (queries x keys) at a healthy false-alarm chance of 1e-3. Measured here: healthy engines (the
reference's scores plus an independent draw of the emulated run's error) and planted wrong indexers."""

from __future__ import annotations

import numpy as np
import pytest

from llmdoctor.checks.compute.allowance import poisson_allowance
from llmdoctor.checks.compute.routing import dsa_misses, dsa_rows, wrong_picks


def _scores(rng, t_n: int, noise: float):
    """(reference scores [T, T] causal, an emulated run's, a healthy engine's picks' scores): both runs are the
    reference plus an independent draw of the same score error."""
    ref = rng.standard_normal((t_n, t_n))
    ref[np.triu_indices(t_n, 1)] = -np.inf
    emu, eng = (ref + noise * rng.standard_normal(ref.shape) for _ in range(2))
    return ref, emu, eng


def _top(scores: np.ndarray, k: int) -> np.ndarray:
    return np.argsort(-np.nan_to_num(scores, nan=-np.inf), axis=1, kind="stable")[:, :k]


def test_poisson_allowance():
    assert poisson_allowance(0.0, 1e-3) == 0
    assert poisson_allowance(1.0, 1e-3) == 5  # P(Poisson(1) > 5) = 6e-4, > 4: 3.7e-3
    assert poisson_allowance(9.0, 1e-3) == 20


def test_a_healthy_engine_raises_no_alarm_in_300_draws():
    """300 healthy engines whose score error is as large as the scores' own spread near the k-th (exact top-k
    sets rare: 85% of the queries differ): no per-key alarm."""
    rng = np.random.default_rng(0)
    k, alarms, shares = 16, 0, []
    for _ in range(300):
        ref, emu, eng = _scores(rng, 48, 0.3)
        (row,) = dsa_rows(1, k, {"indexer_score-0": ref}, {"indexer_score-0": emu}, {"top_k-0": _top(eng, k)}, 1e-3)
        alarms += row["keys"]["wrong"] > row["keys"]["allowance"]
        shares.append(row["disagreement"])
    assert alarms == 0 and np.mean(shares) > 0.8, (alarms, np.mean(shares))


def test_a_negated_indexer_is_found_where_exact_top_k_sets_are_rare():
    """Negated indexer head weights negate every score: the engine picks the lowest-scoring keys. Where the
    engine's score error makes exact top-k sets rare, the share of queries that differ cannot exceed its
    limit; the picks far below the k-th do."""
    rng = np.random.default_rng(1)
    k = 16
    ref, emu, _ = _scores(rng, 48, 1.0)
    (row,) = dsa_rows(1, k, {"indexer_score-0": ref}, {"indexer_score-0": emu},
                      {"top_k-0": _top(np.where(np.isfinite(ref), -ref, -np.inf), k)}, 1e-3)
    assert row["disagreement"] <= row["limit"], row  # the share of queries cannot fail here
    keys = row["keys"]
    assert keys["wrong"] > 4 * keys["allowance"], keys  # 110 against 22 (seed 1)
    assert dsa_misses(row).startswith(f"{keys['wrong']} of {keys['picks']} picks of the {keys['queries']} queries "
                                      "that choose score below the k-th best by more than the engine's score error")


def test_invalid_and_duplicate_picks_are_wrong():
    rng = np.random.default_rng(2)
    ref, emu, _ = _scores(rng, 24, 1e-6)
    picks = _top(ref, 8)
    got = wrong_picks(ref, picks, emu, 8)
    assert got["wrong"] == 0 and got["queries"] == 16 and got["picks"] == 16 * 8, got
    picks[20, 0], picks[21, 1], picks[22, 2] = -1, 23, picks[22, 3]  # padding, a future key, a duplicate
    assert wrong_picks(ref, picks, emu, 8)["wrong"] == 3


@pytest.mark.slow
def test_an_fp8_indexer_is_healthy_per_key_and_a_negated_one_is_not(tmp_path):
    """The tiny GLM-5 with vLLM's FP8 CUDA indexer emulated (tests/reference/test_emulate_vllm.py): an FP8
    engine's picks (float32 around the FP8 indexer: another draw than the budget's bfloat16 one) stay within
    the per-key allowance in every layer, where in layer 2 the share-of-queries limit exceeds 100% (it cannot
    fail there); an engine picking the lowest-scoring keys there (negated indexer weights) is found."""
    import torch

    import fixtures_mla
    from test_emulate_vllm import vllm_cuda

    from llmdoctor.reference import load

    top_k = 16
    fixture = fixtures_mla.build("glm", tmp_path, index_topk=top_k, index_head_dim=128, index_n_heads=8,
                                 indexer_types=["full", "full", "full"])
    ids = [(7 * i + 3) % 90 for i in range(48)]

    def run(dtype, emulate):
        with load(fixture.gguf_path, dtype=dtype, cache=True) as m:
            _, caps = m.forward(ids, capture={"top_k-*", "indexer_score-*"}, emulate=emulate)
        return {k: v.float().numpy() for k, v in caps.items()}

    fp8 = vllm_cuda(indexer_fp8=128)
    ref, emulated, engine = run(torch.float32, None), run(torch.bfloat16, fp8), run(torch.float32, fp8)
    rows = dsa_rows(3, top_k, ref, emulated, engine, 1e-3 / 6)
    for r in rows:
        print(r["layer"], r["disagreement"], r["limit"], r["keys"])
        assert dsa_misses(r) == "" and r["keys"]["wrong"] <= r["keys"]["allowance"], r
    negated = np.where(np.isfinite(ref["indexer_score-2"]), -ref["indexer_score-2"], -np.inf)
    bad = dsa_rows(3, top_k, ref, emulated, {**engine, "top_k-2": _top(negated, top_k)}, 1e-3 / 6)[2]
    assert bad["disagreement"] <= bad["limit"] and bad["keys"]["wrong"] > bad["keys"]["allowance"], bad
    assert "picks of the 32 queries that choose score below the k-th best" in dsa_misses(bad)
