"""checks/compute/error_pattern.py: the spread of an engine's error over positions, heads and channels, read as
a class of cause (issue 22 part 3). Each class is planted on a synthetic capture [T, H, D]; the emulated
run is the reference plus float32-sized noise, so every slice's limit is derived as in layer localization."""

from __future__ import annotations

import numpy as np

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


def test_two_dimensional_points():
    """kqv_out / l_out are [T, C]: positions and channels only."""
    ref, emu, engine = (x.reshape(T, H * D) for x in _runs())
    engine[3:] += 0.1
    p = error_pattern(engine, ref, emu)
    assert p.kind == "position" and p.wrong_positions == list(range(3, T))
