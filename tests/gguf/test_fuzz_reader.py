"""Fuzzing the reader: mutated and truncated valid files raise GGUFError or parse cleanly, never more.

Bounded for CI (about a minute); bench/fuzz_reader.py runs the long campaign.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_builders import exercise, seed_files

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    return seed_files(tmp_path_factory.mktemp("seeds"))


mutation = st.tuples(st.integers(0, 10_000), st.integers(0, 255))
u64_patch = st.tuples(st.integers(0, 10_000), st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]))


def mutate(seed: bytes, flips, patches, cut) -> bytes:
    """`seed` with single bytes set, little-endian u64 values written over, then cut short."""
    data = bytearray(seed)
    for pos, val in flips:
        data[pos % len(data)] = val
    for pos, val in patches:
        pos %= max(1, len(data) - 8)
        data[pos : pos + 8] = struct.pack("<Q", val)
    if cut is not None:
        data = data[: cut % (len(data) + 1)]
    return bytes(data)


def test_unmutated_seeds_parse(tmp_path, seeds):
    """The fuzz below starts from files the reader accepts (else rejecting everything would pass)."""
    for i, data in enumerate(seeds):
        path = tmp_path / f"seed{i}.gguf"
        path.write_bytes(data)
        assert exercise(path) is True


@settings(max_examples=10000, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, 2),
    flips=st.lists(mutation, max_size=8),
    patches=st.lists(u64_patch, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_mutated_files_only_raise_gguf_error(tmp_path, seeds, which, flips, patches, cut):
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(mutate(seeds[which], flips, patches, cut))
    exercise(path)


@pytest.fixture(scope="module")
def seed_set(seeds, tmp_path_factory):
    """A valid 2-shard set (gguf-split's layout) of the first seed file: the bytes of each shard."""
    from split_builders import copy_model

    d = tmp_path_factory.mktemp("seed_set")
    (d / "a.gguf").write_bytes(seeds[0])
    return [p.read_bytes() for p in copy_model(d / "a.gguf", d / "s.gguf", max_tensors=1)]


def test_unmutated_shard_set_parses_as_one_model(tmp_path, seed_set):
    from llmdoctor.gguf import open_gguf

    for i, data in enumerate(seed_set):
        (tmp_path / f"s-{i + 1:05d}-of-00002.gguf").write_bytes(data)
    assert exercise(tmp_path / "s-00002-of-00002.gguf") is True
    with open_gguf(tmp_path / "s-00002-of-00002.gguf") as g:
        assert len(g.shards) == 2 and len(g.tensors) == 2


@settings(max_examples=500, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    which=st.integers(0, 1),
    opened=st.integers(0, 1),
    flips=st.lists(mutation, max_size=8),
    patches=st.lists(u64_patch, max_size=3),
    cut=st.one_of(st.none(), st.integers(0, 10_000)),
)
def test_mutated_shard_sets_only_raise_gguf_error(tmp_path, seed_set, which, opened, flips, patches, cut):
    """One shard of a split set mutated, the set opened through either shard (split.py's rules too)."""
    for i, data in enumerate(seed_set):
        (tmp_path / f"s-{i + 1:05d}-of-00002.gguf").write_bytes(mutate(data, flips, patches, cut) if i == which else data)
    exercise(tmp_path / f"s-{opened + 1:05d}-of-00002.gguf")
