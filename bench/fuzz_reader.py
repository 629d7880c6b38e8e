"""Long fuzz campaign for the GGUF reader: N mutated/truncated inputs, 0 crashes or hangs allowed.

    python bench/fuzz_reader.py --inputs 1000000 --workers 2

Each input is a seed file with random byte flips, random 64-bit patches (counts, lengths, offsets)
and an optional truncation. Outcomes: parsed, rejected (GGUFError), crash (any other exception),
hang (no verdict within --hang-s). Prints a JSON summary; exit 1 on any crash or hang.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import struct
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from gguf_builders import exercise, seed_files  # noqa: E402

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


def worker(args: tuple[int, int, float, list[bytes]]) -> dict:
    wid, n, hang_s, seeds = args
    rng = random.Random(wid)
    path = Path(tempfile.gettempdir()) / f"llmdoctor-fuzz-{os.getpid()}.gguf"
    signal.signal(signal.SIGALRM, _alarm)
    out = {"inputs": 0, "parsed": 0, "rejected": 0, "crashes": 0, "hangs": 0, "examples": []}
    for _ in range(n):
        data = mutate(rng, rng.choice(seeds))
        path.write_bytes(data)
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
    path.unlink(missing_ok=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--inputs", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--hang-s", type=float, default=2.0)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        seeds = seed_files(Path(d))
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
