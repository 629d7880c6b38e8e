"""Long fuzz campaign for the GGUF reader: N mutated/truncated inputs, 0 crashes or hangs allowed.

    python bench/fuzz_reader.py --inputs 1000000 --workers 2

Each input is a seed file with random byte flips, random 64-bit patches (counts, lengths, offsets)
and an optional truncation; or a seed split set (2 shards in gguf-split's layout) with one shard
mutated that way, opened through a random shard. Outcomes: parsed, rejected (GGUFError), crash (any other exception),
hang (no verdict within --hang-s). Prints a JSON summary; exit 1 on any crash or hang.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gguf_builders import exercise, seed_files
from split_builders import copy_model

_U64 = [0, 1, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1]


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang()


def mutate(rng: random.Random, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(rng.randint(0, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    for _ in range(rng.randint(0, 3)):
        pos = rng.randrange(max(1, len(data) - 8))
        val = rng.choice(_U64) if rng.random() < 0.7 else rng.getrandbits(64)
        data[pos : pos + 8] = struct.pack("<Q", val)
    if rng.random() < 0.3:
        data = data[: rng.randrange(len(data) + 1)]
    return bytes(data)


def _write_input(rng: random.Random, seed: bytes | list[bytes], d: Path) -> tuple[Path, bytes]:
    """The mutated input on disk: (the file to open, the mutated bytes)."""
    if isinstance(seed, bytes):
        data = mutate(rng, seed)
        (d / "fuzz.gguf").write_bytes(data)
        return d / "fuzz.gguf", data
    which, n = rng.randrange(len(seed)), len(seed)
    for i, shard in enumerate(seed):
        data_i = mutate(rng, shard) if i == which else shard
        (d / f"s-{i + 1:05d}-of-{n:05d}.gguf").write_bytes(data_i)
        if i == which:
            data = data_i
    return d / f"s-{rng.randrange(n) + 1:05d}-of-{n:05d}.gguf", data


def worker(args: tuple[int, int, float, list]) -> dict:
    wid, n, hang_s, seeds = args
    rng = random.Random(wid)
    d = Path(tempfile.mkdtemp(prefix=f"llmdoctor-fuzz-{os.getpid()}-"))
    signal.signal(signal.SIGALRM, _alarm)
    out = {"inputs": 0, "parsed": 0, "rejected": 0, "crashes": 0, "hangs": 0, "examples": []}
    for _ in range(n):
        path, data = _write_input(rng, rng.choice(seeds), d)
        signal.setitimer(signal.ITIMER_REAL, hang_s)
        try:
            out["parsed" if exercise(path) else "rejected"] += 1
        except Hang:
            out["hangs"] += 1
            out["examples"].append({"kind": "hang", "hex": data[:256].hex()})
        except Exception:
            out["crashes"] += 1
            out["examples"].append({"kind": "crash", "trace": traceback.format_exc(limit=3), "hex": data[:256].hex()})
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        out["inputs"] += 1
    shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=2.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        seeds: list = seed_files(Path(d))
        (Path(d) / "set.gguf").write_bytes(seeds[0])
        seeds.append([p.read_bytes() for p in copy_model(Path(d) / "set.gguf", Path(d) / "s.gguf", max_tensors=1)])
    chunk = a.inputs // a.workers
    t0 = time.time()
    with mp.Pool(a.workers) as pool:
        parts = pool.map(worker, [(w, chunk, a.hang_s, seeds) for w in range(a.workers)])
    total = {k: sum(p[k] for p in parts) for k in ("inputs", "parsed", "rejected", "crashes", "hangs")}
    total["seconds"] = round(time.time() - t0, 1)
    total["examples"] = [e for p in parts for e in p["examples"]][:5]
    print(json.dumps(total, indent=2))
    return 1 if total["crashes"] or total["hangs"] else 0


if __name__ == "__main__":
    sys.exit(main())
