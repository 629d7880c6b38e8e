"""GPU dequantization benchmark and check (H200 through the device tool): Triton kernels vs copy bandwidth.

    python bench/bench_dequant_gpu.py pack DIR [--mb 40]   # here: demo tensors' bytes + gguf-py hashes
    python bench/bench_dequant_gpu.py asm                  # here (Triton, no GPU): PTX instruction counts
    python bench/bench_dequant_gpu.py run [--demo DIR] [--sweep] [--json PATH]   # on the GPU

`run` does, in one call:
1. bit-exactness on the demo tensors packed in DIR: our float32 output against gguf-py run there and
   against the sha256 of gguf-py's output computed where DIR was packed;
2. per type, the time of one launch over 2**28 output elements (1 GiB of float32; input and output
   far larger than the 60 MB L2) on random bytes, as the median of `triton.testing.do_bench`;
   GB/s counts the bytes read plus the bytes written, against a device-to-device copy of a 1 GiB
   buffer in the same run (counted the same way: 2 GiB per copy). With --sweep, every (BB, num_warps)
   candidate is timed and its output checked bit for bit against the tuned configuration's.
Random blocks are not forced finite here: the kernels have no data-dependent branches, so the
values do not change the time (bit-exactness on finite random blocks is tests/gguf/test_dequant_cuda.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

OUT_ELEMS = 1 << 28  # output elements per timed launch (1 GiB float32)


class Log(list):
    """Lines for the JSON record, each printed as it comes (a run cut short still shows its start)."""

    def append(self, line: str) -> None:
        print(line, flush=True)
        super().append(line)


def pack(dest: Path, mb: float) -> None:
    """Write a subset of the demo file's tensors (every type, up to `mb` MB) and gguf-py output hashes."""
    from gguf.quants import dequantize

    from llmdoctor.demo import model_path
    from llmdoctor.gguf import open_gguf

    f = open_gguf(model_path())
    dest.mkdir(parents=True, exist_ok=True)
    by_type: dict[str, list] = {}
    for t in f.tensors:
        if t.type.name not in ("F32", "F16", "BF16"):
            by_type.setdefault(t.type.name, []).append(t)
    budget = mb * 1e6 / len(by_type)  # bytes per type
    manifest = []
    for name, tensors in by_type.items():
        used = 0
        for t in sorted(tensors, key=lambda t: t.nbytes):  # many small ones before one huge one
            raw = np.asarray(t.data)
            shape = tuple(t.shape)
            if used + raw.nbytes > budget:  # take whole rows of what fits
                rows = int((budget - used) // (raw.nbytes // shape[0]))
                if rows < 1:
                    break
                raw = raw[: rows * (raw.nbytes // shape[0])]
                shape = (rows, *shape[1:])
            ref = dequantize(raw, t.type)
            fname = f"{len(manifest):03d}.bin"
            (dest / fname).write_bytes(raw.tobytes())
            manifest.append(dict(name=t.name, type=name, shape=shape, file=fname,
                                 sha256=hashlib.sha256(ref.astype(np.float32).tobytes()).hexdigest()))
            used += raw.nbytes
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"packed {len(manifest)} tensors, {sum((dest / m['file']).stat().st_size for m in manifest) / 1e6:.1f} MB")


def check_demo(src: Path, log: list) -> bool:
    """Our kernels on the packed demo tensors, bit for bit against gguf-py (there) and the packed hashes."""
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from llmdoctor.gguf import dequant_cuda

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: under TRITON_INTERPRET=1
    ok = True
    per_type: dict[str, list[int]] = {}
    for m in json.loads((src / "manifest.json").read_text()):
        q = GGMLQuantizationType[m["type"]]
        raw = np.fromfile(src / m["file"], dtype=np.uint8)
        got = dequant_cuda.launch(torch.from_numpy(raw).to(dev), q).cpu().numpy().reshape(-1)
        want = dequantize(raw, q).reshape(-1)
        n_bad = int((got.view(np.uint32) != want.view(np.uint32)).sum())
        hash_ok = hashlib.sha256(got.tobytes()).hexdigest() == m["sha256"]
        counts = per_type.setdefault(m["type"], [0, 0, 0])
        counts[0] += 1
        counts[1] += got.size
        counts[2] += n_bad + (not hash_ok)
        if n_bad or not hash_ok:
            ok = False
            log.append(f"DEMO MISMATCH {m['name']} {m['type']}: {n_bad} elements differ, hash ok={hash_ok}")
    for name, (n_t, n_e, bad) in per_type.items():
        log.append(f"demo {name}: {n_t} tensors, {n_e} elements, {'bit-exact' if not bad else 'MISMATCH'}")
    return ok


def check_nonfinite(log: list) -> None:
    """Blocks of random bytes whose float16 scales may be inf or NaN: where do we differ from gguf-py?
    Expected: only in the bits of NaNs (NumPy on x86 keeps NaN payloads and makes 0 * inf the negative
    default NaN; the GPU returns its canonical NaN)."""
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    from llmdoctor.gguf import dequant_cuda

    rng = np.random.default_rng(1)
    for q in dequant_cuda._SPECS:
        raw = rng.integers(0, 256, size=(1 << 14, GGML_QUANT_SIZES[q][1]), dtype=np.uint8)
        got = dequant_cuda.launch(torch.from_numpy(raw).cuda(), q).cpu().numpy().reshape(-1)
        with np.errstate(all="ignore"):
            want = dequantize(raw, q).reshape(-1)
        diff = got.view(np.uint32) != want.view(np.uint32)
        both_nan = diff & np.isnan(got) & np.isnan(want)
        log.append(f"non-finite scales {q.name}: {int(np.isnan(want).sum())} NaN in gguf-py, {int(diff.sum())} "
                   f"elements differ in bits, {int(both_nan.sum())} of them NaN on both sides")


def asm_report(log: list) -> None:
    """Compile each tuned kernel for sm_90 (no GPU needed) and count its PTX memory and float
    instructions: are stores 16 bytes wide, are loads repeated, is any multiply-add fused? Also
    registers and spills."""
    import collections
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from llmdoctor.gguf import dequant_cuda

    aligned = [["tt.divisibility", 16]]  # torch allocations are 256-byte aligned
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for q, (kernel, consts, (bb, w)) in dequant_cuda._SPECS.items():
        sig = {"raw": "*u8", "out": "*fp32", "n_blocks": "i32", "kv": "*fp32", "BB": "constexpr"}
        sig.update({k: "constexpr" for k in consts})
        src = ASTSource(fn=kernel, signature=sig, constexprs={"BB": bb, **consts},
                        attrs={(0,): aligned, (1,): aligned, (3,): aligned})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=w, enable_fp_fusion=False))
        ops = collections.Counter(re.findall(r"\b(ld\.global[.\w]*|st\.global[.\w]*|fma\.rn\.f32)", ck.asm["ptx"]))
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "k.ptx").write_text(ck.asm["ptx"])
            v = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                               capture_output=True, text=True).stderr
        regs = re.search(r"Used (\d+) registers", v)
        spills = re.search(r"(\d+) bytes spill stores", v)
        log.append(f"{q.name:7} BB={bb:<3} w={w} regs={regs.group(1) if regs else '?'} "
                   f"spill={spills.group(1) if spills else '?'} shared={ck.metadata.shared} "
                   f"layout_converts={ck.asm['ttgir'].count('convert_layout')} {dict(sorted(ops.items()))}")


def bench(sweep: bool, log: list) -> list[dict]:
    import torch
    import triton
    from gguf import GGML_QUANT_SIZES

    from llmdoctor.gguf import dequant_cuda

    dev = torch.device("cuda")
    src = torch.randn(OUT_ELEMS, device=dev)
    dst = torch.empty_like(src)
    t_copy = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")  # noqa: F821 (before the del)
    copy_gbs = 2 * src.numel() * 4 / (t_copy * 1e-3) / 1e9
    log.append(f"copy: {t_copy * 1e3:.1f} us for 2 x 1 GiB -> {copy_gbs:.0f} GB/s (read + write)")
    t_fill = triton.testing.do_bench(lambda: dst.fill_(1.0), warmup=50, rep=300, return_mode="median")
    fill_gbs = src.numel() * 4 / (t_fill * 1e-3) / 1e9
    log.append(f"fill: {t_fill * 1e3:.1f} us for 1 GiB -> {fill_gbs:.0f} GB/s (write only)")
    del src
    out = dst  # reused output buffer, float32 [OUT_ELEMS]
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for q, (_, _, (bb0, w0)) in dequant_cuda._SPECS.items():
        block_size, type_size = GGML_QUANT_SIZES[q]
        n = OUT_ELEMS // block_size
        blocks = torch.randint(0, 256, (n, type_size), dtype=torch.uint8, device=dev, generator=gen)
        o = out.view(n, block_size)
        nbytes = blocks.numel() + o.numel() * 4
        configs = [(bb0, w0)]
        if sweep:
            bbs = (16, 32, 64, 128) if block_size == 32 else (2, 4, 8, 16, 32)
            grid = [(bb, w) for bb in bbs for w in (4, 8)] + [(2 * bbs[-2], 16)]
            configs += [c for c in grid if c != (bb0, w0)]
        configs.append((bb0, w0))  # the tuned configuration again, last: the spread of two timings
        results = []
        ref_bits = None
        for bb, w in configs:
            fn = lambda: dequant_cuda.launch(blocks, q, bb=bb, num_warps=w, out=o)  # noqa: E731, F821 (before the del)
            fn()
            torch.cuda.synchronize()
            bits = o.view(torch.int32)
            if ref_bits is None:
                ref_bits = bits.clone()
                same = True
            else:
                same = bool(torch.equal(bits, ref_bits))
            t = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
            results.append(dict(bb=bb, warps=w, us=t * 1e3, gbs=nbytes / (t * 1e-3) / 1e9, same=same))
        del ref_bits, blocks
        tuned, again, best = results[0], results[-1], max(results, key=lambda r: r["gbs"])
        rows.append(dict(type=q.name, bytes=nbytes, tuned=tuned, again=again, best=best, all=results,
                         pct_copy=100 * tuned["gbs"] / copy_gbs, best_pct_copy=100 * best["gbs"] / copy_gbs))
        if not all(r["same"] for r in results):
            log.append(f"{q.name}: SWEEP OUTPUTS DIFFER: {[r for r in results if not r['same']]}")
    log.append(f"{'type':8} {'tuned BB,w':>10} {'us':>8} {'GB/s':>6} {'%copy':>6} {'again':>6} | "
               f"{'best BB,w':>10} {'GB/s':>6} {'%copy':>6}")
    for r in rows:
        t, b = r["tuned"], r["best"]
        log.append(f"{r['type']:8} {t['bb']:>6},{t['warps']:<3} {t['us']:8.1f} {t['gbs']:6.0f} {r['pct_copy']:6.1f} "
                   f"{r['again']['gbs']:6.0f} | {b['bb']:>6},{b['warps']:<3} {b['gbs']:6.0f} {r['best_pct_copy']:6.1f}")
    return [dict(copy_gbs=copy_gbs, copy_us=t_copy * 1e3, fill_gbs=fill_gbs, fill_us=t_fill * 1e3)] + rows


def run(args: argparse.Namespace) -> int:
    import torch
    import triton

    log = Log()
    props = torch.cuda.get_device_properties(0)
    log.append(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {props.name} ({props.multi_processor_count} SMs), "
               f"torch {torch.__version__}, triton {triton.__version__}")
    ok = True
    if args.demo:
        ok = check_demo(Path(args.demo), log)
    check_nonfinite(log)
    results = bench(args.sweep, log)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(log=log, demo_ok=ok, results=results), indent=1))
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("dest", type=Path)
    p.add_argument("--mb", type=float, default=40.0)
    sub.add_parser("asm")
    r = sub.add_parser("run")
    r.add_argument("--demo", type=Path)
    r.add_argument("--sweep", action="store_true")
    r.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.dest, args.mb)
        return 0
    if args.cmd == "asm":
        asm_report(Log())
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
