"""A GLM-5-shaped diagnosis on one device (issue 23 part 1): write a synthetic glm-dsa GGUF with GLM-5's real
widths, diagnose it (`diagnose --engine transformers --engine-dtype bfloat16 --device D --max-gpu-memory N`),
print each stage's time and the slowest one with the rate that bounds it, then plant two faults in the file
(one expert's block scales; the indexer's head weights) and check that the diagnosis names each at its layer.

    python bench/bench_glm5.py --out /tmp/glm5                      # GLM-5 widths, on CUDA (the H200 call)
    python bench/bench_glm5.py --out /tmp/glm5-tiny --scale tiny --device cpu   # the CPU smoke test

GLM-5's widths are transformers' GlmMoeDsaConfig defaults, which its docstring gives as zai-org/GLM-5's
(hidden 6144, 64 heads, q/kv LoRA ranks 2048/512, qk rope/nope 64/192, v 256, indexer 32 heads x 128 with
top-k 2048, experts of 2048 with 8 used and 1 shared, dense FFN 12288, vocabulary 154880); the layer count and
the routed-expert count are reduced (--layers, --experts) to fit the device's disk and time.

The file is quantized as the seed's is (Q4_K_M: Q4_K matrices, Q6_K output, F32 norms, router and indexer head
weights; rows whose length is no multiple of 256, attn_k_b's 192, in Q8_0 as llama.cpp falls back). There is
no float model to quantize (a 6-layer GLM-5 is ~12 billion weights): the K-quant blocks are drawn directly as
llama.cpp's quantizer writes them (Q4_K: 6-bit sub-block scale and min codes whose largest is 63 in every
block, d spread log-normally, dmin = 7.5 d with min codes equal to scale codes, so that every sub-block is
centered; Q6_K: int8 scales whose extreme is -128), so checks/file/forensics.py's block rules hold on the clean
file. Weights come out with RMS 1/sqrt(fan-in), so activations stay O(1) through the layers.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT, MODEL_TENSOR

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fixtures_mla  # the converter's metadata for a glm-dsa config
from kquant_blocks import q4_k_blocks, q6_k_blocks  # blocks as llama.cpp's quantizer writes them

from llmdoctor.reference.device_cache import human
from llmdoctor.reference.forward import tensor_name

# GLM-5 (transformers GlmMoeDsaConfig defaults, zai-org/GLM-5), layers and routed experts reduced.
GLM5 = dict(vocab_size=154880, hidden_size=6144, intermediate_size=12288, moe_intermediate_size=2048,
            num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, kv_lora_rank=512, q_lora_rank=2048,
            qk_rope_head_dim=64, qk_nope_head_dim=192, v_head_dim=256, n_group=1, topk_group=1,
            num_experts_per_tok=8, routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5,
            index_topk=2048, index_head_dim=128, index_n_heads=32, max_position_embeddings=202752,
            rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})
# The CPU smoke test: every quantized row a multiple of 256, the same structure.
TINY = dict(GLM5, vocab_size=512, hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
            num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=256, q_lora_rank=256, qk_rope_head_dim=32,
            qk_nope_head_dim=64, v_head_dim=128, num_experts_per_tok=2, index_topk=16, index_head_dim=64,
            index_n_heads=2, max_position_embeddings=4096)


def config(scale: str, layers: int, experts: int, dense: int) -> dict:
    c = dict(GLM5 if scale == "glm5" else TINY)
    c.update(num_hidden_layers=layers, n_routed_experts=experts, first_k_dense_replace=dense,
             indexer_types=["full"] * layers, model_type="glm_moe_dsa")
    return c


def tensors(c: dict) -> list[tuple[str, tuple[int, ...], float]]:
    """(GGUF name, row-major shape, RMS of its weights) of every tensor, in the converter's order; an RMS of
    0 marks a norm (weights near 1)."""
    H, Q, R, Dr, Dn, Dv, Nh = (c[k] for k in ("hidden_size", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                                               "qk_nope_head_dim", "v_head_dim", "num_attention_heads"))
    Hi, Di, E, Fe, F = (c[k] for k in ("index_n_heads", "index_head_dim", "n_routed_experts",
                                        "moe_intermediate_size", "intermediate_size"))
    fan = lambda n: 1 / math.sqrt(n)  # noqa: E731
    M = MODEL_TENSOR
    out = [(tensor_name(M.TOKEN_EMBD), (c["vocab_size"], H), 1.0)]
    for il in range(c["num_hidden_layers"]):
        t = lambda kind, shape, rms, suffix="weight": out.append((tensor_name(kind, il, suffix), shape, rms))  # noqa: E731
        t(M.ATTN_NORM, (H,), 0)
        t(M.ATTN_Q_A, (Q, H), fan(H))
        t(M.ATTN_Q_A_NORM, (Q,), 0)
        t(M.ATTN_Q_B, (Nh * (Dn + Dr), Q), fan(Q))
        t(M.ATTN_KV_A_MQA, (R + Dr, H), fan(H))
        t(M.ATTN_KV_A_NORM, (R,), 0)
        t(M.ATTN_K_B, (Nh, R, Dn), fan(Dn))
        t(M.ATTN_V_B, (Nh, Dv, R), fan(R))
        t(M.ATTN_OUT, (H, Nh * Dv), fan(Nh * Dv))
        t(M.INDEXER_K_NORM, (Di,), 0)
        t(M.INDEXER_K_NORM, (Di,), 0.1, "bias")
        t(M.INDEXER_PROJ, (Hi, H), fan(H))
        t(M.INDEXER_ATTN_K, (Di, H), fan(H))
        t(M.INDEXER_ATTN_Q_B, (Hi * Di, Q), fan(Q))
        t(M.FFN_NORM, (H,), 0)
        if il < c["first_k_dense_replace"]:
            t(M.FFN_GATE, (F, H), fan(H))
            t(M.FFN_UP, (F, H), fan(H))
            t(M.FFN_DOWN, (H, F), fan(F))
            continue
        t(M.FFN_GATE_INP, (E, H), fan(H))
        t(M.FFN_EXP_PROBS_B, (E,), 0.05, "bias")
        t(M.FFN_GATE_EXP, (E, Fe, H), fan(H))
        t(M.FFN_UP_EXP, (E, Fe, H), fan(H))
        t(M.FFN_DOWN_EXP, (E, H, Fe), fan(Fe))
        t(M.FFN_GATE_SHEXP, (Fe, H), fan(H))
        t(M.FFN_UP_SHEXP, (Fe, H), fan(H))
        t(M.FFN_DOWN_SHEXP, (H, Fe), fan(Fe))
    out += [(tensor_name(M.OUTPUT_NORM), (H,), 0), (tensor_name(M.OUTPUT), (c["vocab_size"], H), fan(H))]
    return out


def qtype_of(name: str, shape: tuple[int, ...]) -> QT:
    """Q4_K_M's choice for a synthetic file: F32 for 1-D tensors, the router and the indexer's head weights;
    Q6_K for the output matrix; Q4_K where rows are a multiple of 256; else Q8_0 (llama.cpp's fallback)."""
    if len(shape) == 1 or "ffn_gate_inp" in name or "indexer.proj" in name:
        return QT.F32
    if name.startswith("output."):
        return QT.Q6_K
    return QT.Q4_K if shape[-1] % 256 == 0 else QT.Q8_0


def tensor_bytes(name: str, shape: tuple[int, ...], rms: float, qt: QT, gen: torch.Generator, device: str,
                 rng: np.random.Generator) -> np.ndarray:
    """The tensor's data as the file stores it: F32 values, or uint8 [..., row bytes] of quantized blocks."""
    if qt == QT.F32:
        v = rng.standard_normal(shape, dtype=np.float32) * (rms or 0.1)
        return v + 1 if rms == 0 else v  # norms: near 1
    bs, ts = GGML_QUANT_SIZES[qt]
    if qt == QT.Q8_0:
        return gguf.quants.quantize(rng.standard_normal(shape, dtype=np.float32) * rms, qt)
    n = int(np.prod(shape)) // bs
    blocks = (q4_k_blocks if qt == QT.Q4_K else q6_k_blocks)(n, rms, gen, device)
    return blocks.cpu().numpy().reshape(*shape[:-1], shape[-1] // bs * ts)


def write_file(path: Path, c: dict, *, device: str, seed: int = 0) -> int:
    """Write the synthetic file tensor by tensor (no whole model in memory); its size in bytes."""
    arch = "glm-dsa"
    meta = fixtures_mla.gguf_metadata(arch, c)
    meta[gguf.Keys.General.FILE_TYPE] = (int(gguf.LlamaFileType.MOSTLY_Q4_K_M), gguf.GGUFValueType.UINT32)
    w = gguf.GGUFWriter(str(path), arch)
    for key, (value, vtype) in meta.items():
        if key == gguf.Keys.General.ARCHITECTURE:
            continue
        w.add_array(key, value) if vtype == gguf.GGUFValueType.ARRAY else w.add_key_value(key, value, vtype)
    w.add_string(gguf.Keys.Tokenizer.MODEL, "none")  # no tokenizer: the diagnosis is given token ids
    plan = [(name, shape, rms, qtype_of(name, shape)) for name, shape, rms in tensors(c)]
    for name, shape, _, qt in plan:
        bs, ts = GGML_QUANT_SIZES[qt]
        if qt == QT.F32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            byte_shape = (*shape[:-1], shape[-1] // bs * ts)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    for name, shape, rms, qt in plan:
        w.write_tensor_data(np.ascontiguousarray(tensor_bytes(name, shape, rms, qt, gen, device, rng)))
    w.close()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the diagnosis runs in a child process: give it the GPU memory back
    return path.stat().st_size


# ---- faults planted in the file ----------------------------------------------------------------------------

def plant(path: Path, expert_layer: int, indexer_layer: int, factor: float = 16.0) -> list[str]:
    """Multiply expert 0's block scales d (and dmin) in blk.{expert_layer}.ffn_down_exps and the whole
    blk.{indexer_layer}.indexer.proj (F32) by `factor`, in place; the tensors' names."""
    from llmdoctor.gguf import open_gguf

    exps = tensor_name(MODEL_TENSOR.FFN_DOWN_EXP, expert_layer)
    proj = tensor_name(MODEL_TENSOR.INDEXER_PROJ, indexer_layer)
    with open_gguf(path) as g:
        te, tp = g.tensor(exps), g.tensor(proj)
        spans = (te.offset, te.nbytes // te.shape[0], te.type_size), (tp.offset, tp.nbytes)
    mm = np.memmap(path, dtype=np.uint8, mode="r+")
    off, n, ts = spans[0]
    blocks = mm[off:off + n].reshape(-1, ts)
    blocks[:, 0:4] = (blocks[:, 0:4].copy().view(np.float16) * np.float16(factor)).view(np.uint8)  # d, dmin
    off, n = spans[1]
    mm[off:off + n] = (mm[off:off + n].copy().view(np.float32) * np.float32(factor)).view(np.uint8)
    mm.flush()
    del mm
    return [exps, proj]


# ---- the diagnosis --------------------------------------------------------------------------------------------

BOUNDS = {  # what each stage's time is made of, to name with its measured rate
    "read": "parsing, hashing and the CPU forensics over the file's bytes (page cache or disk)",
    "decode": "dequantizing weights onto the device (the quantized bytes copied there, then the kernels)",
    "reference": "the reference's float32/bfloat16 products and attention on the device",
    "engine": "transformers: building the bfloat16 model (its own dequantization) and its eager forward pass",
    "judging": "the checks' comparisons on the CPU (captures, KL over the vocabulary, op substitution's reruns)",
}


def diagnose(path: Path, ids: list[int], device: str, cap: str, timeout: float,
             extra: list[str]) -> tuple[dict, float, int]:
    cmd = [sys.executable, "-m", "llmdoctor.cli", "diagnose", "--gguf", str(path), "--engine", "transformers",
           "--engine-dtype", "bfloat16", "--device", device, "--max-gpu-memory", cap,
           "--token-ids", ",".join(map(str, ids)), "--json", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if not p.stdout.strip():
        sys.exit(f"diagnose produced no JSON (exit {p.returncode}): {p.stderr[-3000:]}")
    return json.loads(p.stdout), wall, p.returncode


def save(folder: Path | None, name: str, doc: dict) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"diagnose-{name}.json").write_text(json.dumps(doc, indent=1))


def report(doc: dict, wall: float, size: int, cap: str) -> str:
    stages = doc["stages_s"]
    for k in BOUNDS:
        print(f"  {k:10s} {stages.get(k, 0.0):8.2f} s")
    print(f"  {'total':10s} {sum(stages.values()):8.2f} s (wall with start-up {wall:.1f} s)")
    slow = max(stages, key=stages.get)
    dev = doc.get("device") or {}
    rates = {"read": f"{size / 1e9 / max(stages.get('read', 0), 1e-9):.2f} GB of file per second of reading",
             "decode": f"{dev.get('tensors_decoded', 0)} tensors decoded"}
    print(f"slowest stage: {slow} ({stages[slow]:.1f} s): {BOUNDS.get(slow, '?')}"
          + (f"; {rates[slow]}" if slow in rates else ""))
    hyp = max(doc["timings_s"], key=doc["timings_s"].get)
    print(f"slowest hypothesis: {hyp} ({doc['timings_s'][hyp]:.1f} s, its stages counted above)")
    print(f"device memory: cap {human(dev.get('cap_bytes') or 0)}; the reference's weights peaked at "
          f"{human(dev.get('peak_live_bytes', 0))} (one layer's working set {human(dev.get('working_set_bytes', 0))}, "
          f"cached at the end {human(dev.get('held_bytes', 0))}); CUDA's peak allocation, engine included: "
          f"{human(dev.get('cuda_max_allocated_bytes', 0))}")
    return slow


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--scale", choices=("glm5", "tiny"), default="glm5")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dense", type=int, default=1, help="leading dense layers (GLM-5: 3)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (GLM-5: 256; default 48, tiny 16)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default: the indexer's top-k + 256, so "
                    "that the sparse selection matters)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-gpu-memory", default=None, help="default: 4GB for glm5, 2 x one layer for tiny")
    ap.add_argument("--budget-s", type=float, default=570, help="the whole run's time; the fault run is skipped "
                    "when what is left cannot hold another diagnosis")
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--save", type=Path, default=None, help="write each diagnosis's JSON there")
    ap.add_argument("--generate", type=int, default=None, help="diagnose's --generate (the decode path's new "
                    "tokens; 0: not examined; default: diagnose's own)")
    a = ap.parse_args()
    t_start = time.perf_counter()
    a.out.mkdir(parents=True, exist_ok=True)
    a.experts = a.experts or (48 if a.scale == "glm5" else 16)
    c = config(a.scale, a.layers, a.experts, a.dense)
    path = a.out / f"glm5-{a.scale}-{a.layers}L-{a.experts}E.gguf"
    t0 = time.perf_counter()
    size = write_file(path, c, device=a.device)
    t_write = time.perf_counter() - t0
    print(f"wrote {path} ({size / 1e9:.2f} GB, {a.layers} layers, {a.experts} experts) in {t_write:.1f} s")
    from llmdoctor.gguf import open_gguf
    from llmdoctor.reference.device_cache import minimum_bytes

    with open_gguf(path) as g:
        one_layer = minimum_bytes(g, 4)
    cap = a.max_gpu_memory or ("4GB" if a.scale == "glm5" else str(2 * one_layer))
    T = a.tokens or c["index_topk"] + (256 if a.scale == "glm5" else 16)
    ids = [int(i) for i in np.random.default_rng(1).integers(0, c["vocab_size"], size=T)]
    print(f"diagnose: {T} tokens, --device {a.device} --max-gpu-memory {cap} (one float32 layer: "
          f"{human(one_layer)}; the file: {human(size)})")
    extra = [] if a.generate is None else ["--generate", str(a.generate)]
    left = a.budget_s - (time.perf_counter() - t_start)
    doc, wall, code = diagnose(path, ids, a.device, cap, timeout=max(left, 30), extra=extra)
    save(a.save, "healthy", doc)
    print(f"healthy file: exit {code}, verdict: {doc['verdict']}")
    for f in doc["findings"]:
        if f["status"] == "fail":
            print(f"  FAIL {f['check']} {f['target']}: {f.get('explanation') or f.get('reason')}")
    report(doc, wall, size, cap)
    ok = code == 0
    if a.no_faults:
        return 0 if ok else 1
    left = a.budget_s - (time.perf_counter() - t_start)
    if left < 1.1 * wall:
        print(f"faults: skipped: {left:.0f} s left of --budget-s {a.budget_s:.0f}, a diagnosis took {wall:.0f} s")
        return 0 if ok else 1
    moe = list(range(c["first_k_dense_replace"], a.layers))
    names = plant(path, expert_layer=moe[len(moe) // 2], indexer_layer=a.layers - 2)
    print(f"planted: {names[0]} expert 0's block scales x16; {names[1]} x16")
    doc, wall, code = diagnose(path, ids, a.device, cap, timeout=max(left, 30), extra=extra)
    save(a.save, "faulty", doc)
    print(f"faulty file: exit {code}, verdict: {doc['verdict']} ({wall:.1f} s)")
    for name in names:
        hit = [f for f in doc["findings"] if f["status"] == "fail" and name in (f["target"] or "")]
        layer = name.split(".")[1]
        print(f"  {name}: {'named at layer ' + layer + ': ' + (hit[0].get('explanation') or '')[:160] if hit else 'NOT NAMED'}")
        ok = ok and bool(hit)
    ok = ok and code == 1
    print("result:", "ok" if ok else "FAILED", f"({time.perf_counter() - t_start:.0f} s in all)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
