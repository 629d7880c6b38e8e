"""The sha256 of a model file for the report's provenance, remembered between runs.

A GLM-5-sized GGUF is hundreds of GB: hashing it takes minutes, and every command's report names the
file by its hash. The digest is kept in llmdoctor's own cache ($XDG_CACHE_HOME/llmdoctor, else
~/.cache/llmdoctor; never beside the model, which is only ever opened read-only), keyed by the file's
identity and state (real path, device, inode, size, modification time in ns): a file changed in any of
those is hashed again. A cache that cannot be read or written costs the hash, never the command.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_NAME = "file-sha256.json"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmdoctor" / CACHE_NAME


def _key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}"


def _read_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _remember(key: str, digest: str) -> None:
    target = cache_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        entries = {k: v for k, v in _read_cache().items() if Path(k.split("|", 1)[0]).exists()}
        entries[key] = digest
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=0))
        os.replace(tmp, target)
    except OSError:
        pass  # read-only home, full disk: the digest is still right, only not remembered


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of the file's bytes (from the cache when the file is unchanged since it was hashed)."""
    p = Path(path)
    key = _key(p)
    if isinstance(digest := _read_cache().get(key), str):
        return digest
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    _remember(key, digest)
    return digest
