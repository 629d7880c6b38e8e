"""The provenance digest of a model file: hashed once, remembered while the file is unchanged, never
written beside the model, and right even when the cache cannot be written."""

from __future__ import annotations

import hashlib
import json
import os

from llmdoctor import file_digest


def test_remembered_while_unchanged_and_hashed_again_after_a_change(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = tmp_path / "models" / "m.gguf"
    model.parent.mkdir()
    model.write_bytes(b"GGUF" + bytes(range(256)) * 1000)
    want = hashlib.sha256(model.read_bytes()).hexdigest()
    assert file_digest.sha256_file(model) == want
    assert sorted(p.name for p in model.parent.iterdir()) == ["m.gguf"]  # nothing beside the model
    # the second call reads the cache, not the file: a planted cache entry is what it returns
    cache = file_digest.cache_path()
    entries = json.loads(cache.read_text())
    (key,) = entries
    cache.write_text(json.dumps({key: "remembered"}))
    assert file_digest.sha256_file(model) == "remembered"
    # the file changed (same size, new bytes, new mtime): hashed again
    model.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 1000)
    os.utime(model, ns=(1, 2))
    assert file_digest.sha256_file(model) == hashlib.sha256(model.read_bytes()).hexdigest() != want


def test_an_unwritable_cache_costs_the_hash_only(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"x" * 4096)
    assert file_digest.sha256_file(model) == hashlib.sha256(b"x" * 4096).hexdigest()
    assert file_digest.sha256_file(model) == hashlib.sha256(b"x" * 4096).hexdigest()
