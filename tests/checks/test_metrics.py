"""checks/metrics.py: each metric on hand-computed cases, and planted failures each metric must see."""

import math

import pytest
import torch

from llmdoctor.checks import metrics as M


def test_norms_on_known_values():
    want = torch.tensor([3.0, 4.0])
    got = torch.tensor([3.0, 5.0])
    assert M.max_abs_diff(got, want) == 1.0
    assert M.rel_l2(got, want) == pytest.approx(1 / 5)
    assert M.nmse(got, want) == pytest.approx(1 / 25)
    assert M.cosine(want, want) == pytest.approx(1.0)
    assert M.cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])) == 0.0
    assert M.cosine(-want, want) == pytest.approx(-1.0)


def test_edge_cases_zero_and_empty():
    z = torch.zeros(3)
    assert M.rel_l2(z, z) == 0.0 and M.rel_l2(torch.ones(3), z) == math.inf
    assert M.max_abs_diff(torch.zeros(0), torch.zeros(0)) == 0.0
    assert M.cosine(z, z) == 1.0
    with pytest.raises(ValueError):
        M.max_abs_diff(torch.zeros(2), torch.zeros(3))


def test_nonfinite_is_seen():
    want = torch.tensor([1.0, 2.0, math.inf])
    got = torch.tensor([1.0, math.nan, math.inf])
    assert math.isnan(M.max_abs_diff(got, want))
    assert M.nonfinite_where_finite(got, want).tolist() == [False, True, False]
    assert M.abs_diff(got, want)[2] == 0  # equal infinities do not differ
    assert M.over_budget(got, want, torch.full((3,), 1e9)).tolist() == [False, True, False]
    both_nan = torch.tensor([math.nan, 1.0])
    assert M.over_budget(both_nan, torch.tensor([math.nan, math.nan]), torch.ones(2)).tolist() == [False, True]


def test_kl_and_top1():
    want = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    assert M.kl_divergence(want, want).abs().max() < 1e-12
    assert M.kl_divergence(want + 7.0, want).abs().max() < 1e-12  # softmax is shift-invariant
    got = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, 5.0]])
    kl = M.kl_divergence(got, want)
    p = torch.softmax(want[0].double(), 0)
    q = torch.softmax(got[0].double(), 0)
    assert kl[0] == pytest.approx(float((p * (p.log() - q.log())).sum()))
    assert kl[1] == pytest.approx(0.0)
    lp = torch.log_softmax(want, -1)
    assert M.kl_divergence(torch.log_softmax(got, -1), lp, logprobs=True)[0] == pytest.approx(float(kl[0]))
    assert M.top1_agreement(got, want) == 0.5
    # a tie in got at want's top-1 agrees, whichever of the tied tokens got's argmax names
    assert M.top1_agreement(torch.tensor([[0.0, 2.0, 2.0]]), torch.tensor([[0.0, 1.0, 3.0]])) == 1.0
    assert M.top1_agreement(torch.tensor([[2.0, 2.0, 1.0]]), torch.tensor([[0.0, 1.0, 3.0]])) == 0.0
    # a flat output (every token at the maximum) is no tie: it disagrees, and its margin counts
    flat, peaked = torch.zeros(1, 4), torch.tensor([[0.0, 7.0, 6.0, 5.0]])  # flat's argmax: token 0
    assert M.top1_agreement(flat, peaked) == 0.0 and float(M.top1_margin(flat, peaked)) == 7.0


def test_bit_mismatch_and_ulps():
    a = torch.tensor([1.0, -0.0, 0.0, 1.0], dtype=torch.float32)
    b = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float32)
    b[3] = torch.nextafter(b[3], torch.tensor(2.0))
    assert M.bit_mismatch(a, b).tolist() == [False, True, False, True]
    assert M.ulp_distance(a, b).tolist() == [0, 0, 0, 1]  # -0 and +0 are the same point on the line
    tiny = torch.tensor([-1.4e-45], dtype=torch.float32)  # the negative smallest subnormal
    assert M.ulp_distance(tiny, torch.tensor([1.4e-45])).tolist() == [2]
    h = torch.tensor([1.0], dtype=torch.float16)
    assert M.ulp_distance(h, torch.tensor([1.0009765625], dtype=torch.float16)).tolist() == [1]
    with pytest.raises(ValueError):
        M.bit_mismatch(a, b.double())


def test_differing_bits_names_the_fields():
    want = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float32)
    got = want.clone()
    got[1] = -2.0  # sign only
    got[2] = 6.0  # exponent only
    got[3] = torch.nextafter(want[3], torch.tensor(9.0))  # last mantissa bit
    s = M.differing_bits(got, want)
    assert (s["elements"], s["sign"], s["exponent"], s["mantissa"]) == (3, 1, 1, 1)
    assert s["per_bit"][31] == 1 and s["per_bit"][0] == 1 and s["max_ulp"] > 1
    assert M.differing_bits(want, want)["elements"] == 0


def test_budget_units_and_bound():
    assert M.unit_roundoff(torch.float32) == 2.0**-24
    assert M.unit_roundoff(torch.float16) == 2.0**-11
    assert M.unit_roundoff(torch.bfloat16) == 2.0**-8
    assert M.underflow_unit(torch.float16) == 2.0**-25
    assert M.gamma(2, 0.01) == pytest.approx(0.02 / 0.98)
    with pytest.raises(ValueError):
        M.gamma(300, 2.0**-8)
    bound = M.rounding_bound(torch.tensor([1.0, 0.0]), torch.float16, 2)
    assert bound[0] == pytest.approx(M.gamma(2, 2.0**-11) + 2 * 2.0**-25)
    assert bound[1] == 2 * 2.0**-25


def test_budget_holds_for_real_half_arithmetic_and_catches_a_planted_error():
    # d*q + m evaluated in float16 (2 roundings) against the float64 value: always inside the bound.
    g = torch.Generator().manual_seed(0)
    d = torch.rand(10000, generator=g, dtype=torch.float64) * 1e-2
    q = torch.randint(0, 16, (10000,), generator=g).double()
    m = -torch.rand(10000, generator=g, dtype=torch.float64) * 0.1
    d16, m16 = d.half(), m.half()
    exact = d16.double() * q + m16.double()
    half = (d16 * q.half() + m16).double()
    bound = M.rounding_bound(d16.double() * q.abs() + m16.double().abs(), torch.float16, 2)
    assert not M.over_budget(half, exact, bound).any()
    planted = half.clone()
    planted[17] += 4 * float(bound[17])
    assert M.over_budget(planted, exact, bound).nonzero().flatten().tolist() == [17]


def test_rel_l2_from_sums_matches_rel_l2_over_pieces():
    from llmdoctor.checks.metrics import rel_l2, rel_l2_from_sums

    want = torch.tensor([1.0, -2.0, 3.0, 0.5])
    got = torch.tensor([1.5, -2.0, 2.0, 0.5])
    pieces = [(got[:2], want[:2]), (got[2:], want[2:])]
    err = sum(float(((g - w) ** 2).sum()) for g, w in pieces)
    ref = sum(float((w ** 2).sum()) for _, w in pieces)
    assert rel_l2_from_sums(err, ref) == pytest.approx(rel_l2(got, want), rel=1e-12)
    assert rel_l2_from_sums(0.0, 0.0) == 0.0 and rel_l2_from_sums(1.0, 0.0) == float("inf")


def test_spearman_ranks():
    from llmdoctor.checks.metrics import spearman

    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == -1.0
    assert spearman([1, 2, 3, 4, 5], [1, 3, 2, 5, 4]) == pytest.approx(0.8)
    assert spearman([1, 2], [2, 1]) == 0.0


def test_logsumexp_and_its_grouped_form():
    import math

    assert M.logsumexp([-1000.0, -1000.0]) == pytest.approx(-1000.0 + math.log(2))  # no underflow to -inf
    assert M.logsumexp([]) == -math.inf
    lp = torch.tensor([-1.0, -2.0, -800.0, -801.0, -3.0], dtype=torch.float64)
    got = M.grouped_logsumexp(lp, [0, 0, 1, 1, 2], 4)
    assert got[0] == pytest.approx(M.logsumexp([-1.0, -2.0])) and got[1] == pytest.approx(M.logsumexp([-800.0, -801.0]))
    assert got[2] == -3.0 and got[3] == -math.inf


def test_sq_sums_accumulate_rel_l2_and_nan_equal_bits():
    got, want = torch.tensor([1.0, 2.0, 3.0, 5.0]), torch.tensor([1.0, 2.5, 3.0, 4.0])
    pieces = [M.sq_sums(got[:2], want[:2]), M.sq_sums(got[2:], want[2:])]
    assert M.rel_l2_from_sums(*map(sum, zip(*pieces))) == pytest.approx(M.rel_l2(got, want), rel=1e-12)
    assert M.sq_sums(torch.tensor([float("nan")]), torch.tensor([1.0]))[0] == float("inf")
    a = torch.tensor([float("nan"), 1.0])
    b = torch.tensor([1.0, 1.0]).view(torch.int32)
    b[0] = 0x7FC00001  # another NaN payload
    b = b.view(torch.float32)
    assert M.bit_mismatch(a, b).tolist() == [True, False]
    assert M.bit_mismatch(a, b, nan_equal=True).tolist() == [False, False]
