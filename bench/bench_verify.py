"""verify against the same-run read rate, in every mode, with its memory (issue 23 part 2).

    python bench/bench_verify.py [--gb 4] [--file F] [--devices cpu,cuda] [--caches cold,warm]
                                 [--manifest] [--repeat 1] [--out DIR] [--keep]

The file: --file, or a synthetic GGUF of --gb GB written by this script (write_synthetic: Q4_K, Q6_K,
Q8_0 and F32 tensors of 64M values, random blocks whose scales are finite float16, so every value
decodes finite; removed afterwards unless --keep). For each cache state (cold: the file's pages
evicted first, see `evict`; warm: read once just before), in one run on the one file:
  read      the anchor: one sequential pass, os.readv into one reused 16 MiB buffer, in this process
  dd        the anchor of issue 23's table: `dd if=FILE of=/dev/null bs=16M`, a child
  verify    checks.file.verify.run in a child process per device (what `llmdoctor verify` does, the
            forensics statistics included); with --manifest also `verify+manifest` (write_manifest:
            every tensor's sha256 in the same pass)
Per verify run: the pass's GB/s (timed inside the child, as the command reports it) and with the
child's start-up (wall), the ratio of the pass to the faster anchor of the same cache state, the
child's max RSS (os.wait4's ru_maxrss) and CPU seconds per GB (of the pass, every thread of the child,
and of the whole child, start-up included): on a loaded machine the steadier figure. Prints one JSON object, and writes it
and a markdown summary table under --out after every step (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter

from llmdoctor.checks.file.block_scales import SCALE_FIELDS
from llmdoctor.gguf import open_gguf

READ_BUFFER = 16 << 20
TENSOR_VALUES = 1 << 26  # 64M values per synthetic tensor (a 2048 x 32768 matrix)
MIX = (Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.F32)  # roughly a Q4_K_M file's byte mix, with F32


def _blocks(qtype: Q, n_values: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_blocks, type_size] random blocks with every float16 scale field finite (1e-3..1e-2)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if qtype == Q.F32:
        return rng.standard_normal(n_values, dtype=np.float32).view(np.uint8).reshape(-1, 4)
    b = rng.integers(0, 256, size=(n_values // bs, ts), dtype=np.uint8)
    for f in SCALE_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 1e-2, size=len(b)).astype("<f2")
        b[:, f.offset : f.offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return b


def write_synthetic(path: Path, gb: float) -> Path:
    """A GGUF of about `gb` GB: tensors blk.N.<role> cycling through MIX, each 64M values; one block
    template per type, written again for every tensor of that type (the bytes a disk reads are real)."""
    rng = np.random.default_rng(0)
    templates = {q: _blocks(q, TENSOR_VALUES, rng) for q in set(MIX)}
    plan, size, i = [], 0, 0
    while size < gb * 1e9:
        q = MIX[i % len(MIX)]
        plan.append((f"blk.{i // len(MIX)}.t{i % len(MIX)}.weight", q))
        size += templates[q].nbytes
        i += 1
    w = GGUFWriter(str(path), "llama")
    for name, q in plan:
        w.add_tensor_info(name, (2048, TENSOR_VALUES // 2048), np.dtype(np.float32), templates[q].nbytes, raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, q in plan:
        w.write_tensor_data(templates[q].reshape(2048, -1))
    w.close()
    return path


def _files(path: Path) -> list[str]:
    with open_gguf(path) as g:
        return [s.path for s in g.shards]


def evict(path: Path) -> str:
    """Drop the file's pages from the page cache; returns how."""
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise(DONTNEED)"


def read_all(path: Path) -> int:
    buf = bytearray(READ_BUFFER)
    n = 0
    for p in _files(path):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while got := os.readv(fd, [buf]):
                n += got
        finally:
            os.close(fd)
    return n


CHILD = """
import json, sys, time
from pathlib import Path
import importlib
V = importlib.import_module(sys.argv[4])
t0, c0 = time.perf_counter(), time.process_time()
r = V.run(Path(sys.argv[1]), device=sys.argv[2], **({"write_manifest": True} if sys.argv[3] == "1" else {}))
print(json.dumps({"pass_s": r.seconds, "bytes": r.bytes, "findings": len(r.findings),
                  "non_finite": r.totals()["non_finite"], "in_child_s": time.perf_counter() - t0,
                  "pass_cpu_s": time.process_time() - c0,
                  "manifest_tensors": len(r.manifest["tensors"]) if getattr(r, "manifest", None) else None}))
"""


def verify_child(path: Path, device: str, manifest: bool, module: str = "llmdoctor.checks.file.verify") -> dict:
    """One verify pass in a child process: its own figures, wall time with start-up, max RSS, CPU."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(path), device, "1" if manifest else "0", module],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        return {"error": f"exit {p.returncode}: {err[-800:]}"}
    r = json.loads(out.strip().splitlines()[-1])
    size = r["bytes"]
    if r["pass_s"] <= 0:
        return {"error": "no pass: the device is not available"}
    return {"pass_s": round(r["pass_s"], 3), "wall_s": round(wall, 3), "GB/s": round(size / r["pass_s"] / 1e9, 3),
            "wall_GB/s": round(size / wall / 1e9, 3), "max_rss_GB": round(ru.ru_maxrss * 1024 / 1e9, 3),
            "cpu_s_per_GB": round((ru.ru_utime + ru.ru_stime) / size * 1e9, 3),
            "pass_cpu_s_per_GB": round(r["pass_cpu_s"] / size * 1e9, 3), "non_finite": r["non_finite"],
            "findings": r["findings"], "manifest_tensors": r["manifest_tensors"]}


def agree(gb: float, devices: list[str]) -> dict:
    """The devices' reports on one small synthetic file with a planted +inf block scale (faults'
    scale-inf, block 3 of blk.0.t2.weight, a Q6_K tensor): the same per-tensor counts, first bad block
    and offset, sha256 and finding statuses on each, rms within 1e-5 relative (the pieces are summed
    in another order on the GPU)."""
    import tempfile

    import torch

    from llmdoctor import faults
    from llmdoctor.checks.file import verify as V

    with tempfile.TemporaryDirectory() as d:
        src = write_synthetic(Path(d) / "small.gguf", gb)
        bad = faults.get("scale-inf").build(src, Path(d), tensor="blk.0.t2.weight", block=3)
        runs = {dev: V.run(bad, device=dev, write_manifest=True) for dev in devices
                if dev != "cuda" or torch.cuda.is_available()}
    key = lambda r: [(t.name, t.values, t.non_finite, t.first_bad_block, t.first_bad_offset, t.sha256)  # noqa: E731
                     for t in r.tensors]
    status = lambda r: [(f.check, f.target, f.status) for f in r.findings]  # noqa: E731
    first = next(iter(runs.values()))
    out = {"devices": list(runs), "bad_tensors": [t.name for t in first.tensors if t.non_finite],
           "first_bad_block": [t.first_bad_block for t in first.tensors if t.non_finite]}
    for dev, r in runs.items():
        rms = [abs(a.stats["rms"] - b.stats["rms"]) / b.stats["rms"] for a, b in zip(r.tensors, first.tensors)
               if a.stats and b.stats and b.stats["rms"] > 0]
        out[dev] = {"reports_agree": key(r) == key(first), "statuses_agree": status(r) == status(first),
                    "manifest_agrees": r.manifest == first.manifest, "max_rms_rel_diff": max(rms, default=0.0),
                    "failed": [(f.check, f.target) for f in r.findings if f.status == "fail"]}
    return out


def dd(path: Path) -> None:
    for p in _files(path):
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)


def timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def summary(result: dict) -> str:
    rows = ["| run | cache | mode | read GB/s | dd GB/s | verify GB/s (wall with start-up) | ratio (wall) "
            "| max RSS GB | CPU s/GB: pass (child) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["runs"]:
        for mode, v in r["verify"].items():
            if "error" in v:
                rows.append(f"| {r['run']} | {r['cache']} | {mode} | {r['read']} | {r['dd']} | {v['error'][:80]} | | | |")
                continue
            rows.append(f"| {r['run']} | {r['cache']} | {mode} | {r['read']} | {r['dd']} | {v['GB/s']} ({v['wall_GB/s']}) "
                        f"| **{v['ratio']}** ({v['wall_ratio']}) | {v['max_rss_GB']} "
                        f"| {v['pass_cpu_s_per_GB']} ({v['cpu_s_per_GB']}) |")
    head = f"agreement of the devices on a planted file: {json.dumps(result['agree'])}\n\n" if "agree" in result else ""
    return head + f"file {result['file']} ({result['bytes'] / 1e9:.1f} GB), {result['cpus']} CPUs, evicted by " \
           f"{result.get('evicted_by')}, load average before {result['load_average_before']}\n\n" + "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--file", type=Path)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--caches", default="cold,warm")
    ap.add_argument("--manifest", action="store_true")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--ab", metavar="MODULE", help="also time this module's run() (an A/B against another "
                    "version of checks/file/verify.py, e.g. an earlier commit's copied to llmdoctor/checks/_verify_old.py)")
    ap.add_argument("--agree-gb", type=float, default=0.0, help="first, the devices' reports on a small "
                    "synthetic file of this size with a planted fault (see agree); 0: not run")
    a = ap.parse_args()
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
                    "load_average_before": [round(x, 1) for x in os.getloadavg()], "runs": []}
    if a.agree_gb > 0:
        result["agree"] = agree(a.agree_gb, a.devices.split(","))
        print(json.dumps({"agree": result["agree"]}), file=sys.stderr, flush=True)

    def save() -> None:
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "verify-bench.json").write_text(json.dumps(result, indent=2))
            (a.out / "verify-summary.md").write_text(summary(result))

    path = a.file
    if path is None:
        path = Path(os.environ.get("TMPDIR", "/tmp")) / "llmdoctor-bench-verify.gguf"
        t0 = time.perf_counter()
        write_synthetic(path, a.gb)
        result["synthetic_write_s"] = round(time.perf_counter() - t0, 1)
    with open_gguf(path) as g:
        size = sum(t.nbytes for t in g.tensors)
    result.update(file=str(path), bytes=size)
    devices = a.devices.split(",")
    # the four modes first, then the manifest and A/B variants against the same anchors (a run cut short
    # by a time limit loses the variants, not a mode)
    phases = [[(d, False, None) for d in devices],
              [(d, True, None) for d in devices if a.manifest] + [(d, False, a.ab) for d in devices if a.ab]]
    try:
        for run in range(a.repeat):
            rows = {}
            for modes in phases:
                for cache in a.caches.split(",") if modes else ():
                    r = rows.get(cache)
                    if r is None:
                        r = rows[cache] = {"run": run, "cache": cache, "verify": {}}
                        result["runs"].append(r)
                        for name, fn in (("read", read_all), ("dd", dd)):
                            if cache == "cold":
                                result["evicted_by"] = evict(path)
                            else:
                                read_all(path)
                            r[name] = round(size / timed(fn, path) / 1e9, 3)
                    anchor = max(r["read"], r["dd"])
                    for device, manifest, module in modes:
                        if cache == "cold":
                            evict(path)
                        else:
                            read_all(path)  # warm whatever a cold run evicted
                        v = verify_child(path, device, manifest, *([module] if module else []))
                        if "error" not in v:
                            v["ratio"], v["wall_ratio"] = round(v["GB/s"] / anchor, 3), round(v["wall_GB/s"] / anchor, 3)
                        r["verify"][device + ("+manifest" if manifest else "") + (f"@{module}" if module else "")] = v
                        print(json.dumps({cache: v}), file=sys.stderr, flush=True)
                        save()
    finally:
        if a.file is None and not a.keep:
            path.unlink(missing_ok=True)
    result["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    save()
    print(json.dumps(result, indent=2))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
