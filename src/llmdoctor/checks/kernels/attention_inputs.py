"""The inputs of a case: fresh random numbers (never zeros), seeded by `--seed` and the case's name, in
float64 (int32 index tensors); the fp8 latent cache and stale unused cache rows derived from them."""

from __future__ import annotations

import zlib

import torch

from .attention_shapes import Shape
from .attention_suite import Case


def make_inputs(shape: Shape, case: Case, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Fresh float64 inputs (int32 index tensors) of a case, drawn on the CPU (the same numbers on every
    machine), then moved to `device`, where the reference math runs (float64 on the GPU for --device cuda:
    the full-width presets would take minutes on the CPU)."""
    return {n: v.to(device) for n, v in _draw(shape, case, seed).items()}


def case_seed(seed: int, case: Case) -> int:
    """The seed of a case's inputs: the run's seed and the case's NAME (not its position in a selection:
    `--cases long` and the full run must judge `long` on the same numbers)."""
    return seed * 1_000_003 + zlib.crc32(case.name.encode())


def _draw(shape: Shape, case: Case, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=torch.float64)

    lens_q = torch.tensor([t for t, _ in case.seqs])
    lens_k = torch.tensor([s for _, s in case.seqs])
    cu_q = torch.nn.functional.pad(lens_q.cumsum(0), (1, 0)).to(torch.int32)
    x: dict[str, torch.Tensor] = {"cu_q": cu_q}
    if case.contract == "prefill":
        tk = int(lens_k.sum())
        x |= {"q": randn(case.total_q, shape.n_head, shape.head_dim),
              "k": randn(tk, shape.n_head_kv, shape.head_dim),
              "v": randn(tk, shape.n_head_kv, shape.head_dim_v),
              "cu_k": torch.nn.functional.pad(lens_k.cumsum(0), (1, 0)).to(torch.int32)}
        return x
    m = shape.mla
    width, bs = m.kv_lora_rank + m.qk_rope, case.block_size
    pages = [-(-s // bs) for _, s in case.seqs]
    n_blocks = sum(pages) + 2  # + unused pages, left NaN
    order = torch.randperm(n_blocks, generator=gen)
    cache = torch.full((n_blocks, bs, width), float("nan"), dtype=torch.float64)
    table = torch.full((len(case.seqs), max(max(pages), 1) + 1), int(order[-1]), dtype=torch.int32)  # pad: a NaN page
    at = 0
    for b, (_, s) in enumerate(case.seqs):
        blocks = order[at:at + pages[b]]
        at += pages[b]
        table[b, :pages[b]] = blocks.to(torch.int32)
        rows = randn(s, width)
        flat = cache[blocks.long()].reshape(-1, width)
        flat[:s] = rows  # the tail of the last page stays NaN
        cache[blocks.long()] = flat.reshape(-1, bs, width)
    x |= {"q": randn(case.total_q, shape.n_head, width), "kv_cache": cache, "block_table": table,
          "seq_lens": lens_k.to(torch.int32)}
    if case.top_k:
        x["topk"] = _topk(case, gen)
    return x


def _topk(case: Case, gen: torch.Generator) -> torch.Tensor:
    """int32 [total_q, K]: what a DSA indexer emits for each query at position `last` (bottom-right):
    min(K, last + 1) distinct positions in [0, last] in score order (here random), every other row
    holding `last` itself (the causal limit), then -1 padding as a suffix (vLLM's indexer: torch.topk
    over the causal range puts the masked scores last and writes -1 there). probe="duplicates": each
    row lists its first position twice (in place of a pad, or of its last pick), which no indexer does."""
    k = case.top_k
    rows = []
    for t, s in case.seqs:
        for i in range(t):
            last = s - t + i
            n = min(k, last + 1)
            pick = torch.randperm(last + 1, generator=gen)[:n]
            if i % 2 == 0 and not (pick == last).any():
                pick[torch.randint(n, (1,), generator=gen)] = last
            row = torch.cat([pick, torch.full((k - n,), -1, dtype=torch.int64)])
            if case.probe == "duplicates" and n > 1:
                row[n if n < k else n - 1] = row[0]
            rows.append(row)
    return torch.stack(rows).to(torch.int32)


FP8 = torch.float8_e4m3fn


def fp8_cache(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """x with its latent cache rounded through float8_e4m3fn at a per-tensor scale (amax / 448, the
    format's largest finite value), and that scale as `kv_scale`: what an fp8-cache engine stores."""
    cache = x["kv_cache"]
    scale = cache[torch.isfinite(cache)].abs().max() / torch.finfo(FP8).max
    return {**x, "kv_cache": (cache / scale).to(FP8).to(torch.float64) * scale, "kv_scale": scale}


def stale_unused_rows(x: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """x with every unused latent-cache row (the last page's tail, the pad and unused pages: NaN in x)
    holding finite random rows, as a page reused from an earlier request holds them (an fp8 cache's at
    its scale). The follow-up to a NaN output: a kernel that weighs those rows by zero (0 x NaN) is right
    here, one that attends to them is not."""
    cache = x["kv_cache"]
    gen = torch.Generator().manual_seed(seed)
    amax = cache[torch.isfinite(cache)].abs().max()
    fill = torch.randn(cache.shape, generator=gen, dtype=torch.float64).to(cache.device).clamp(-amax, amax)
    if "kv_scale" in x:
        fill = (fill / x["kv_scale"]).to(FP8).to(torch.float64) * x["kv_scale"]
    return {**x, "kv_cache": torch.where(torch.isnan(cache), fill, cache)}


def rounded(x: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The inputs in `dtype` (the reference math on them accumulates in float32)."""
    return {n: (v.to(dtype) if v.is_floating_point() else v) for n, v in x.items()}
