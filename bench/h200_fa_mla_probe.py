"""Which side makes vllm-flashattn-mla's NaN on check attention's mla-decode-long cases (deepseek-v3, bf16):
the adapter (subjects/engines/vllm_kernels.py _flashattn_mla) or FA3's MLA kernel? Run on the H200 by
bench/h200_vllm.sh (issue 22; the NaN was seen in session 5).

Each case is called as the adapter calls it, then with one thing changed:
  as-is          the contract's cache: the tail of each last page and the pad page hold NaN
  finite-tails   the same cache with every NaN row set to 0 (the rows a sequence owns unchanged)
  one-split      as-is, with FA3's key splitting off (num_splits=1)
  vllm-schedule  as-is, with the ahead-of-time scheduler metadata vLLM's FlashAttnMLA builder passes
and each output is compared with the float64 reference on the bf16-rounded inputs (checks/kernels/attention_reference.py).
NaN only "as-is" and none with "finite-tails": the kernel reads keys past seq_lens at zero weight
(0 x NaN); NaN gone with "one-split": FA3's split combine; gone with "vllm-schedule": the adapter
(it passes no scheduler metadata). Prints one JSON line per (case, variant).
Measured on the H200 2026-12-02 (vLLM 0.24.0): NaN as-is, with one split and with vLLM's schedule on
mla-decode-long and mla-decode-long-keys (block size 64), none with finite tails (max error 0.0078 and
0.0077, as the passing cases): the kernel, not the adapter. check attention now judges such a case on
finite unused rows and reports the NaN as information (checks/kernels/attention_verdicts.py `unused_rows_verdict`).

    python bench/h200_fa_mla_probe.py [OUT.json]
"""

from __future__ import annotations

import json
import sys

import torch

from llmdoctor.checks.kernels import attention_reference as case_reference
from llmdoctor.checks.kernels import attention_inputs as inputs
from llmdoctor.checks.kernels import attention_shapes as shapes
from llmdoctor.checks.kernels import attention_suite as suite


def main(out_path: str | None) -> list[dict]:
    from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend
    from vllm.vllm_flash_attn import flash_attn_varlen_func, get_scheduler_metadata

    from llmdoctor.subjects.engines import vllm_kernels as V

    shape = shapes.load_shape("deepseek-v3", None, None)
    fa_mla = V.mla_kernels("cuda", "flashattn-mla")["mla-decode"]
    r = shape.mla.kv_lora_rank
    rows = []
    for case in (c for c in suite.cases(shape) if c.contract == "mla-decode" and not c.fp8_cache):
        x = inputs.make_inputs(shape, case, inputs.case_seed(0, case), device="cuda")
        c = inputs.rounded(x, torch.bfloat16)
        want, _ = case_reference.reference(shape, case, inputs.rounded(x, torch.bfloat16))  # [Tq, H, R] float64

        def direct(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, *, splits=0, schedule=False):
            """The adapter's call, with FA3's split count and vLLM's ahead-of-time schedule as options."""
            cache, table = V.fit_pages(FlashAttnMLABackend, kv_cache, block_table, seq_lens)
            cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            meta = get_scheduler_metadata(  # as FlashAttnMLAMetadataBuilder._schedule_decode asks for it
                batch_size=q.shape[0], max_seqlen_q=1, max_seqlen_k=int(seq_lens.max()), num_heads_q=q.shape[1],
                num_heads_kv=1, headdim=q.shape[-1] - kv_lora_rank, cache_seqlens=seq_lens, qkv_dtype=q.dtype,
                headdim_v=kv_lora_rank, page_size=cache.shape[1], cu_seqlens_q=cu, causal=True,
                num_splits=splits) if schedule else None
            return flash_attn_varlen_func(q=q[..., kv_lora_rank:], k=cache[..., kv_lora_rank:].unsqueeze(-2),
                                          v=cache[..., :kv_lora_rank].unsqueeze(-2), q_v=q[..., :kv_lora_rank],
                                          max_seqlen_q=1, cu_seqlens_q=cu, max_seqlen_k=int(seq_lens.max()),
                                          seqused_k=seq_lens, block_table=table, softmax_scale=softmax_scale,
                                          causal=True, return_softmax_lse=True, fa_version=3,
                                          scheduler_metadata=meta, num_splits=splits)

        finite = c["kv_cache"].nan_to_num(nan=0.0)
        variants = {"as-is": (fa_mla, c["kv_cache"]), "finite-tails": (fa_mla, finite),
                    "one-split": (lambda *a: direct(*a, splits=1), c["kv_cache"]),
                    "vllm-schedule": (lambda *a: direct(*a, schedule=True), c["kv_cache"])}
        for name, (fn, cache) in variants.items():
            row = {"case": case.name, "seqs": [s for _, s in case.seqs], "block_size": case.block_size,
                   "variant": name}
            try:
                out = fn(c["q"], cache, c["block_table"], c["seq_lens"], shape.scale, r)
                out = out[0] if isinstance(out, tuple) else out
                got = out.double()
                bad = ~torch.isfinite(got)
                ok = ~bad
                row |= {"nonfinite": int(bad.sum()), "nonfinite_rows": sorted({int(i) for i in bad.nonzero()[:, 0]})[:8],
                        "max_abs_err_finite": float((got[ok] - want[ok]).abs().max()) if ok.any() else None,
                        "ref_max_abs": float(want.abs().max())}
            except Exception as e:  # the refusal is the row's answer
                row["raised"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
