"""Allowances from randomized draws (checks/compute/allowance.py): stochastic rounding is unbiased, a healthy
draw judged against the others passes at any length, a planted fault beyond its allowance fails and says how
far, a verdict near the edge is marginal."""

from __future__ import annotations

import math

import pytest
import torch

from llmdoctor.checks.compute import allowance as A
from llmdoctor.checks.compute.layers import distribution_criteria, error_curve, first_divergent_layer
from llmdoctor.reference.draws import draw_dtypes, randomized, stochastic_round


def test_stochastic_rounding_is_unbiased_on_the_grid_and_twice_as_noisy():
    x = 3 * torch.randn(20000, dtype=torch.float32)
    ys = torch.stack([stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(i)).float() for i in range(64)])
    lo, hi = torch.minimum(ys.min(0).values, x), torch.maximum(ys.max(0).values, x)
    assert torch.equal(ys.to(torch.bfloat16).float(), ys)  # on bfloat16's grid
    assert bool(((ys == lo) | (ys == hi)).all())  # one of the two neighbours
    assert abs(float(((ys.mean(0) - x) / (x.abs() * 2 ** -8)).mean())) < 0.01  # unbiased (in ulps, on average)
    sr = float((ys - x).pow(2).mean().sqrt())
    rn = float((x.to(torch.bfloat16).float() - x).pow(2).mean().sqrt())
    assert 1.25 < sr / rn < 1.6  # sqrt(2) in theory


def test_randomized_matmul_is_a_fresh_draw_each_seed():
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    exact = a.float() @ b.float()
    with randomized(1, draw_dtypes(False)):
        y1 = a @ b
    with randomized(2, draw_dtypes(False)):
        y2 = a @ b
    assert y1.dtype == torch.bfloat16 and not torch.equal(y1, y2)
    assert float((y1.float() - exact).abs().max()) <= float(exact.abs().max()) * 2 ** -7


def test_a_draw_is_reproducible_by_its_seed():
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    with randomized(5, draw_dtypes(False)):
        y1 = a @ b
    with randomized(5, draw_dtypes(False)):
        y2 = a @ b
    assert torch.equal(y1, y2)


@pytest.mark.gpu
def test_a_draw_on_the_gpu_rounds_the_tensors_of_either_device():
    """A draw of a model on the GPU also makes small tensors on the CPU: each device draws from its own generator
    (the first GPU pass of `diagnose --device cuda` with draws stopped at a generator of the other device)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU on this machine")
    a, b = torch.randn(16, 64).bfloat16(), torch.randn(64, 8).bfloat16()
    with randomized(1, draw_dtypes(False)):
        on_gpu, on_cpu = a.cuda() @ b.cuda(), a @ b
    assert on_gpu.device.type == "cuda" and on_cpu.device.type == "cpu" and on_gpu.dtype == torch.bfloat16
    exact = a.float() @ b.float()
    assert float((on_gpu.cpu().float() - exact).abs().max()) <= float(exact.abs().max()) * 2 ** -7


def test_t_quantile_matches_known_values():
    assert abs(A.t_quantile(0.025, 8) - 2.306) < 1e-3
    assert abs(A.t_quantile(0.005, 4) - 4.604) < 1e-3
    assert abs(A.t_quantile(0.025, 1) - 12.706) < 1e-3 and abs(A.t_quantile(0.025, 7) - 2.365) < 1e-3  # odd dof
    assert abs(A.t_sf(1.0, 1) - 0.25) < 1e-12  # Cauchy: atan(1) = pi/4


# ---- synthetic logits: the reference, healthy draws, a faulty engine ---------------------------

def _logits(t: int, v: int = 300, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(t, v, generator=g, dtype=torch.float64)
    ref[:, 0] += 0.05  # token 0 leads token 1 by little: flips are common
    ref[:, 1] += 0.02 + ref[:, 0] - ref[:, 1]
    return ref


def _draw(ref: torch.Tensor, seed: int, noise: float = 0.03) -> torch.Tensor:
    """A healthy draw: heavy-ish tailed noise (Student t, 5 dof) on every logit."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    chi = torch.stack([torch.randn(ref.shape, generator=g, dtype=torch.float64) ** 2 for _ in range(5)]).mean(0)
    return ref + noise * z / chi.sqrt()


def _judge(ref, engine, draws_logits):
    cols = A.columns(ref, engine)
    draws = [A.summarize(d, {}, ref, {}, cols) for d in draws_logits]
    return {c.name: c for c in distribution_criteria(engine, ref, draws_logits[0], draws=draws, cols=cols)}


def _healthy_passes(lengths):
    for t in lengths:
        ref = _logits(t)
        crit = _judge(ref, _draw(ref, 100), [_draw(ref, i) for i in range(A.N_DRAWS)])
        assert all(c.ok for c in crit.values()), {n: c.reason for n, c in crit.items()}
        assert crit["top1"].evidence, "the near ties flip: the criterion is exercised"


def test_healthy_draw_passes():
    _healthy_passes((16, 256))


@pytest.mark.slow
def test_healthy_draw_passes_on_a_long_prompt():
    _healthy_passes((4096,))


def test_planted_fault_fails_and_says_how_far():
    ref = _logits(64)
    draws = [_draw(ref, i) for i in range(A.N_DRAWS)]
    engine = _draw(ref, 100)
    engine[10, 5] += 6.0  # one position: another token wins by far
    crit = _judge(ref, engine, draws)
    assert not crit["top1"].ok and crit["top1"].evidence[0]["position"] == 10
    assert crit["top1"].times > 1 and "x its allowance" in crit["top1"].reason
    assert not crit["kl_position"].ok
    d = crit["top1"].as_dict()
    assert d["ratio"] == crit["top1"].times and d["marginal"] is False and d["allowance"]["draws"] == A.N_DRAWS


def test_draws_made_before_the_engine_ran_keep_the_reference_columns_alone():
    """Draws shared by several configurations' runs keep the reference's top tokens only (allowance.columns(ref)):
    a healthy engine flipping to a near-tie still passes (a pair the draws did not keep has the vocabulary-averaged
    pair noise), and the planted flip still fails."""
    for t in (16, 256):
        ref = _logits(t)
        cols = A.columns(ref)
        draws_logits = [_draw(ref, i) for i in range(A.N_DRAWS)]
        draws = [A.summarize(d, {}, ref, {}, cols) for d in draws_logits]
        engine = _draw(ref, 100)
        crit = {c.name: c for c in distribution_criteria(engine, ref, draws_logits[0], draws=draws, cols=cols)}
        assert all(c.ok for c in crit.values()), {n: c.reason for n, c in crit.items()}
        engine[3, 250] += 8.0  # a token far down the reference's list wins: not among the kept columns
        assert int(engine[3].argmax()) not in cols[3].tolist()
        crit = {c.name: c for c in distribution_criteria(engine, ref, draws_logits[0], draws=draws, cols=cols)}
        assert not crit["top1"].ok and crit["top1"].evidence[0]["position"] == 3


def test_decode_steps_against_their_draws():
    """checks/compute/decode.judge with draws of the same rows: a healthy engine's steps pass, each step's bound is
    the per-position allowance of the draws' KL there; one wrong decode step is the first wrong and fails."""
    from llmdoctor.checks.compute import decode

    ref = _logits(12)
    cols = A.columns(ref)
    draws_logits = [_draw(ref, i) for i in range(2 * A.N_DRAWS)]
    draws = [A.summarize(d, {}, ref, {}, cols) for d in draws_logits]
    got = _draw(ref, 100)
    ids = [int(r.argmax()) for r in got]
    j = decode.judge(got, None, ref, draws_logits[0], ids, draws, cols, 100)
    assert j.decode_ok and j.first_wrong is None, [c.reason for c in j.decode]
    threshold = next(c.allowance["threshold"] for c in j.decode if c.name == "kl_position")
    kl_d = torch.stack([d.kl for d in draws]).mean(0)
    assert all(abs(st["bound"] - threshold ** 2 * (float(kl_d[i]) + 1e-12)) < 1e-9 for i, st in enumerate(j.steps))
    bad = got.clone()
    bad[5] = ref[5] + 0.5 * torch.randn(ref.shape[1], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    j = decode.judge(bad, None, ref, draws_logits[0], ids, draws, cols, 100)
    assert not j.decode_ok and j.first_wrong == 5


def test_marginal_words():
    assert A.marginal(1.5) and A.marginal(0.6) and not A.marginal(3) and not A.marginal(math.inf)
    assert "marginal" in A.times(1.5) and "longer prompt" in A.times(0.7) and "marginal" not in A.times(5)


def test_layer_points_against_their_draws():
    g = torch.Generator().manual_seed(0)
    names = [f"l_out-{i}" for i in range(6)]
    ref = {n: torch.randn(32, 64, generator=g) for n in names}

    def noisy(seed, fault_from=None):
        gg = torch.Generator().manual_seed(seed)
        out = {n: x + 1e-3 * torch.randn(x.shape, generator=gg) for n, x in ref.items()}
        if fault_from is not None:
            for i in range(fault_from, 6):
                out[f"l_out-{i}"] = out[f"l_out-{i}"] + 0.05 * ref[f"l_out-{i}"]
        return out

    draws = [A.DrawSummary(*(torch.zeros(1),) * 5, points={n: float((d[n] - ref[n]).norm() / ref[n].norm())
                                                          for n in names}) for d in map(noisy, range(1, 9))]
    healthy = error_curve(ref, noisy(20), noisy(21), 6, points=("l_out",), draws=draws)
    assert first_divergent_layer(healthy) == (None, None) and healthy[0].draws == 8
    assert healthy[0].allowance >= A.K_MODEL and "ratio" in healthy[0].as_dict()
    layer, point = first_divergent_layer(error_curve(ref, noisy(20), noisy(21, 3), 6, points=("l_out",), draws=draws))
    assert layer == 3 and point.ratio > A.MARGINAL


def test_decode_points_against_their_draws_with_the_prefill_as_control():
    """checks/compute/decode.judge_points: the decode steps' activations [n-1, D] and the engine's prefill of the same
    positions against the draws' errors there. Healthy: both pass. A fault only in the decode steps from step 4 on
    (row 2) is the decode's, at its layer, first wrong at step 4; the same fault in the prefill too is the control's."""
    from llmdoctor.checks.compute import decode

    g = torch.Generator().manual_seed(0)
    names = [f"kqv_out-{i}" for i in range(4)] + [f"l_out-{i}" for i in range(4)]
    ref = {n: torch.randn(7, 64, generator=g, dtype=torch.float64) for n in names}  # 7 decode steps

    def noisy(seed, fault_layer=None):
        gg = torch.Generator().manual_seed(seed)
        out = {n: x + 1e-3 * torch.randn(x.shape, generator=gg, dtype=torch.float64) for n, x in ref.items()}
        if fault_layer is not None:
            for n in names:
                if int(n.split("-")[1]) >= fault_layer:
                    out[n][2:] += 0.05 * torch.randn(out[n][2:].shape, generator=gg, dtype=torch.float64)
        return out

    def summary(d):
        return A.DrawSummary(*(torch.zeros(1),) * 5, points={n: float((d[n] - ref[n]).norm() / ref[n].norm())
                                                           for n in names})

    draws = [summary(noisy(i)) for i in range(1, 17)]
    healthy = decode.judge_points(noisy(40), noisy(41), ref, noisy(42), 4, draws, 100)
    assert healthy.decode_ok and healthy.control_ok and healthy.first_step is None and len(healthy.decode) == 8
    bad = decode.judge_points(noisy(40, fault_layer=1), noisy(41), ref, noisy(42), 4, draws, 100)
    assert not bad.decode_ok and bad.control_ok
    assert (bad.layer, bad.point.point, bad.first_step) == (1, "kqv_out", 3)  # row 2: step 3 (0-based), step 4 said
    both = decode.judge_points(noisy(40, fault_layer=1), noisy(41, fault_layer=1), ref, noisy(42), 4, draws, 100)
    assert not both.control_ok and both.control_layer == 1


# ---- discrete choices no run replays (allowance.unseen_choices) --------------------------------

def test_poisson_upper_is_garwoods_bound():
    assert abs(A.poisson_upper(0, 0.05) - 2.995732) < 1e-5  # -ln 0.05
    assert abs(A.poisson_upper(3, 0.025) - 8.767273) < 1e-5  # chi2(0.975, 8) / 2
    assert A.poisson_allowance(0.0, 1e-3) == 0 and A.poisson_allowance(1.0, 1e-3) == 5


def test_unseen_choices_false_alarm_rate_is_measured_below_its_level():
    """Rare events at a few positions (near-ties a run takes the other way), each position its own chance: the
    engine's count beyond what its 8 draws' counts allow exceeds it in under `level` of 20,000 healthy trials."""
    import numpy as np

    rng = np.random.default_rng(0)
    p = np.zeros(200)
    p[:12], p[12:15] = 0.04, 0.3  # [T]: most positions never flip; 12 rarely, 3 often
    level, trials = 0.01, 20_000
    draws = rng.random((trials, A.N_DRAWS, 200)) < p  # [trials, N, T]
    engine = (rng.random((trials, 200)) < p).sum(1)  # [trials]
    allowed = {}
    alarms = found = 0
    for seen, got in zip(draws.sum((1, 2)).tolist(), engine.tolist()):
        if seen not in allowed:
            null = torch.zeros(A.N_DRAWS, 200, dtype=torch.bool)
            null.view(-1)[:seen] = True
            allowed[seen] = A.unseen_choices(null, level).allowed
        alarms += got > allowed[seen]
        found += got + 15 > allowed[seen]  # a fault at 15 more positions
    assert alarms / trials < level, (alarms, trials)
    assert found / trials > 0.99, found / trials  # and not vacuous: 15 wrong positions stand out


def _choice_runs(ref: torch.Tensor, seed: int, near_ties: list[int], p: float, flipped: list[int] | None = None):
    """A healthy run that also takes its own discrete choices: at each near-tie position, with chance p (or at
    `flipped`), the position's logits move as a different expert or key would move them (far beyond rounding)."""
    g = torch.Generator().manual_seed(10_000 + seed)
    out = _draw(ref, seed)
    take = flipped if flipped is not None else [t for t in near_ties if float(torch.rand(1, generator=g)) < p]
    for t in take:
        out[t] = out[t] + 0.6 * torch.randn(ref.shape[1], generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    return out


def test_unseen_choices_admit_a_few_flipped_positions_and_still_find_a_fault():
    """Where the engine exposes no choices, a healthy engine's near-tie taken the other way at two positions fails
    the per-position criteria as before (unseen=False) and passes counted against the draws' own (unseen=True), which
    say why; a fault at 40 positions still fails."""
    ref = _logits(200)
    near = list(range(0, 200, 10))  # 20 positions with a near-tie
    draws_logits = [_choice_runs(ref, i, near, 0.02) for i in range(A.N_DRAWS)]
    cols = A.columns(ref)
    draws = [A.summarize(d, {}, ref, {}, cols) for d in draws_logits]

    def judge(engine, unseen):
        return {c.name: c for c in distribution_criteria(engine, ref, draws_logits[0], draws=draws, cols=cols,
                                                         unseen=unseen)}

    healthy = _choice_runs(ref, 100, near, 0.0, flipped=[50, 130])
    assert not judge(healthy, False)["kl_position"].ok
    crit = judge(healthy, True)
    assert all(c.ok for c in crit.values()), {n: c.reason for n, c in crit.items()}
    assert "unseen" in crit["kl_position"].reason and crit["kl_position"].allowance["unseen_choices"]["allowed"] >= 2
    faulty = _choice_runs(ref, 100, near, 0.0, flipped=list(range(3, 200, 5)))
    crit = judge(faulty, True)
    assert not crit["kl_position"].ok and crit["kl_position"].times > 1, crit["kl_position"].reason
