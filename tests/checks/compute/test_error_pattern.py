"""checks/compute/error_pattern.py: the spread of an engine's error over positions, heads and channels, read as
a class of cause (issue 22 part 3). Each class is planted on a synthetic capture [T, H, D]; the emulated
run is the reference plus float32-sized noise, so every slice's limit is derived as in layer localization."""

from __future__ import annotations

import numpy as np
import pytest

from llmdoctor.checks.compute.error_pattern import error_pattern

T, H, D, ROPE = 12, 4, 16, 8


def _runs(seed: int = 0):
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((T, H, D))
    emu = ref + 1e-7 * rng.standard_normal(ref.shape)  # the engine's own rounding, as the emulated run has it
    engine = ref + 1e-7 * rng.standard_normal(ref.shape)
    return ref, emu, engine


def test_healthy_engine_has_no_pattern():
    ref, emu, engine = _runs()
    assert error_pattern(engine, ref, emu, rope_dim=ROPE).kind == "none"


def test_a_wrong_rotary_angle_spares_position_0():
    ref, emu, engine = _runs()
    engine[1:, :, :ROPE] = engine[1:, :, :ROPE][..., ::-1]  # the rotary channels of later positions only
    p = error_pattern(engine, ref, emu, rope_dim=ROPE)
    assert p.kind == "position" and p.wrong_positions[0] == 1 and "position 0" in p.words
    assert "only the rotary channels 0-7" in p.words


def test_one_wrong_head_is_a_layout():
    ref, emu, engine = _runs()
    engine[:, 2] *= 1.05
    p = error_pattern(engine, ref, emu)
    assert p.kind == "heads" and p.wrong_heads == [2] and "heads 2 wrong" in p.words


def test_one_half_of_every_head():
    ref, emu, engine = _runs()
    engine[..., D // 2:] = np.roll(engine[..., D // 2:], 1, axis=-1)
    p = error_pattern(engine, ref, emu, rope_dim=D)
    assert p.kind == "channels" and "one half of every head" in p.words


def test_a_wrong_weight_is_wrong_everywhere():
    ref, emu, engine = _runs()
    engine = engine @ (np.eye(D) + 0.05 * np.random.default_rng(1).standard_normal((D, D)))  # a wrong projection
    p = error_pattern(engine, ref, emu)
    assert p.kind == "everywhere" and "position 0 included" in p.words


def test_most_channels_wrong_without_a_layout_is_everywhere():
    """A scaled op output leaves the channels whose error is small within their noise: a majority of wrong channels
    with no layout among them is not read as a channel layout (the demo's layer-7 attention scales)."""
    ref, emu, engine = _runs()
    engine[..., 3:] *= 1.05  # channels 0-2 untouched
    p = error_pattern(engine, ref, emu)
    assert p.kind == "everywhere" and "13 of 16 channels" in p.words and "channel layout" not in p.words


def test_a_minority_of_channels_is_a_channel_layout():
    ref, emu, engine = _runs()
    engine[..., [1, 6, 11]] *= 1.05
    p = error_pattern(engine, ref, emu)
    assert p.kind == "channels" and p.wrong_channels == [1, 6, 11] and "a channel layout" in p.words


def test_two_dimensional_points():
    """kqv_out / l_out are [T, C]: positions and channels only."""
    ref, emu, engine = (x.reshape(T, H * D) for x in _runs())
    engine[3:] += 0.1
    p = error_pattern(engine, ref, emu)
    assert p.kind == "position" and p.wrong_positions == list(range(3, T))


# ---- RoPE named as the cause, with the variant that reproduces the engine (issue 35 item 3) ----------------------

def _rope_runs(neox: bool, engine_rope, *, t_n: int = 24, h_n: int = 3, dr: int = 16, base: float = 10_000.0):
    """(engine, ref, emu, Rope) of a point right after RoPE (MLA's q_pe: every channel rotates): the reference
    rotates x with reference/attention.py's apply_rope; the engine computes engine_rope(x, positions) [T, H, dr]."""
    import torch

    from llmdoctor.checks.compute.error_pattern import Rope
    from llmdoctor.reference.attention import apply_rope, rope_cos_sin

    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((t_n, h_n, dr)))
    pos = torch.arange(t_n)
    cos, sin = rope_cos_sin(pos, dr, base)
    ref = apply_rope(x, cos, sin, neox=neox).numpy()
    emu = ref + 1e-7 * rng.standard_normal(ref.shape)
    engine = np.asarray(engine_rope(x, pos)) + 1e-7 * rng.standard_normal(ref.shape)
    inv = base ** (-np.arange(0, dr, 2) / dr)
    return engine, ref, emu, Rope(dr, neox, inv, pos.numpy(), base=base)


def _rotated(neox: bool, base: float = 10_000.0, *, sign: float = 1.0, shift: int = 0, scale: float = 1.0):
    from llmdoctor.reference.attention import apply_rope, rope_cos_sin

    def rope(x, pos):
        cos, sin = rope_cos_sin((pos + shift).double() * scale, x.shape[-1], base)
        return apply_rope(x, cos, sign * sin, neox=neox).numpy()

    return rope


def test_a_healthy_rope_is_no_cause():
    engine, ref, emu, rope = _rope_runs(False, _rotated(False))
    p = error_pattern(engine, ref, emu, rope=rope, point="q_pe-0")
    assert p.kind == "none" and p.cause == "" and p.rope is None


@pytest.mark.parametrize("neox", [False, True])
def test_the_other_rope_pairing_is_named(neox):
    """The engine pairs the rotary channels by halves where the reference interleaves them (and the reverse):
    right at position 0 (angle 0 turns nothing, whatever the pairing), wrong after; the experiment names it."""
    engine, ref, emu, rope = _rope_runs(neox, _rotated(not neox))
    p = error_pattern(engine, ref, emu, rope=rope, point="q_pe-0")
    assert p.kind == "position" and p.rope["agrees"]["variant"] == "pairing", p
    other, own = ("interleaved (2i, 2i + 1)", "by halves") if neox else ("by halves (i, i + d/2)", "interleaved")
    assert p.cause.startswith(f"RoPE applied wrongly to q_pe-0: with the rotary pairs taken {other} instead of {own}")
    assert "the engine agrees" in p.cause


@pytest.mark.parametrize("engine_rope, variant, words", [
    (lambda x, pos: x.numpy(), "unrotated", "no rotation at all"),
    (_rotated(False, sign=-1.0), "reversed", "the opposite way"),
    (_rotated(False, base=500_000.0), "base", "rope base of 5e+05 instead of the reference's 1e+04"),
    (_rotated(False, scale=0.25), "scale", "positions scaled by 0.25"),
])
def test_each_rotary_variant_is_named(engine_rope, variant, words):
    engine, ref, emu, rope = _rope_runs(False, engine_rope)
    p = error_pattern(engine, ref, emu, rope=rope, point="q_pe-0")
    assert p.kind == "position" and p.rope["agrees"]["variant"] == variant, (p.rope, p.words)
    assert p.cause.startswith("RoPE applied wrongly to q_pe-0: ") and words in p.cause, p.cause


def test_a_shifted_position_is_named_though_position_0_is_wrong():
    """Positions counted from 1: position 0 turns too, so the spread alone reads as a weight's ("every position
    wrong"); the experiment still finds the rotation that reproduces the engine."""
    engine, ref, emu, rope = _rope_runs(False, _rotated(False, shift=1))
    p = error_pattern(engine, ref, emu, rope=rope, point="k_pe-0")
    assert p.kind == "everywhere" and p.rope["agrees"]["variant"] == "position+1", p.rope
    assert p.cause.startswith("RoPE applied wrongly to k_pe-0: with every position one later (p + 1)")


def test_a_wrong_weight_after_rope_is_not_called_rope():
    """A projection scaled before RoPE (vLLM's planted kv_a_proj rope rows x1.5): wrong at position 0 too,
    every channel: a weight, and no rotary variant is claimed."""
    def scaled(x, pos):
        return _rotated(False)(x * 1.5, pos)

    engine, ref, emu, rope = _rope_runs(False, scaled)
    p = error_pattern(engine, ref, emu, rope=rope, point="k_pe-1")
    assert p.kind == "everywhere" and p.cause == "" and "RoPE" not in p.words


def test_a_later_position_fault_that_is_no_rotation_is_not_named_as_a_variant():
    """Later positions' inputs wrong (not their rotation): the rotary pattern, said as RoPE's, but no variant
    is claimed to reproduce it."""
    def noisy_later(x, pos):
        x = x.clone()
        x[1:] += 0.05 * torch_randn(x[1:].shape)
        return _rotated(False)(x, pos)

    engine, ref, emu, rope = _rope_runs(False, noisy_later)
    p = error_pattern(engine, ref, emu, rope=rope, point="q_pe-0")
    assert p.kind == "position" and p.rope["agrees"] is None, p.rope
    assert "none of the rotary variants tried reproduces it" in p.cause


def torch_randn(shape):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)


def test_positions_shifted_from_mid_prompt_are_named():
    """A later prefill chunk whose positions are one too far (vLLM's chunked prefill, tests/vllm_plants.py's
    chunk-offset): right up to position 5, wrong from there; no whole-prompt variant fits, the step from 5 does."""
    from llmdoctor.reference.attention import apply_rope, rope_cos_sin

    def chunked(x, pos):
        cos, sin = rope_cos_sin((pos + (pos >= 5)).double(), x.shape[-1], 10_000.0)
        return apply_rope(x, cos, sin, neox=False).numpy()

    engine, ref, emu, rope = _rope_runs(False, chunked)
    p = error_pattern(engine, ref, emu, rope=rope, point="Qcur-0")
    assert p.kind == "position" and p.wrong_positions[0] == 5, p.words
    assert p.rope["agrees"]["variant"] == "position+1-from-5", p.rope
    assert p.cause.startswith("RoPE applied wrongly to Qcur-0: with the positions from 5 on one later"), p.cause
