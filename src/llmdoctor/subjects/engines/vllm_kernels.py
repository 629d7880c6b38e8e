"""vLLM's kernels as `check dequant` / `check attention` subjects, beside the engine adapter (vllm.py): its GGUF
dequant op and its attention kernels (FlashAttention varlen, the MLA backends' kernels) called in this process
where vLLM is installed with CUDA beside llmdoctor, and vLLM for CPU's attention kernel through the engine's
driver in the deployment's interpreter (`cpu_attention`).

As read from the vLLM 0.24.0 wheel and vllm-gguf-plugin 0.0.5 (issue 22): the GGUF ops live in the
plugin; the attention kernels in vllm.vllm_flash_attn and vllm.v1.attention.ops, called as each
backend's forward calls them; what a backend takes (dtypes, head sizes, kernel page sizes) is read from
its class, so a case it would refuse is skipped with vLLM's own list, never run outside its range.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

from .vllm import QUERY_TIMEOUT_S, _call, default_python_or_reason

# (module with ggml_dequantize, module with the type tables): the plugin, else vLLM's in-tree GGUF
# (vLLM before the GGUF split)
_GGUF_OPS = (("vllm_gguf_plugin.ops", "vllm_gguf_plugin.quantization.utils"),
             ("vllm._custom_ops", "vllm.model_executor.layers.quantization.gguf"))


def _type_name(qtype: int) -> str:
    import gguf

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:
        return f"type {qtype}"


def _installed_version() -> str:
    """vLLM's version in llmdoctor's own environment (the deployment's may differ: it is its driver's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vllm")
    except PackageNotFoundError:
        return "not installed beside llmdoctor"


def dequant_gate(tables: Any) -> Callable[[int], None]:
    """A check raising Unsupported for a GGML type vLLM's GGUF layers never dequantize: F32, F16 and BF16
    weights are used as they are (`UNQUANTIZED_TYPES`), anything outside `DEQUANT_TYPES` has no
    dequantizer. `tables` is the module holding both sets (the plugin's quantization.utils)."""
    from ..kernel_errors import Unsupported

    plain = {int(t) for t in tables.UNQUANTIZED_TYPES}
    handled = {int(t) for t in tables.DEQUANT_TYPES}
    where = tables.__name__

    def gate(qtype: int) -> None:
        if qtype in plain:
            raise Unsupported(f"vllm: {_type_name(qtype)} weights are used as they are, never dequantized "
                              f"({where}.UNQUANTIZED_TYPES)")
        if qtype not in handled:
            raise Unsupported(f"vllm: no GGUF dequantizer for {_type_name(qtype)} ({where}.DEQUANT_TYPES)")

    return gate


def dequant_kernel(device: str) -> Callable:
    """vLLM's GGUF dequant op as a dequant kernel `(raw, qtype, shape, dtype) -> tensor`, CUDA only: the
    vllm-gguf-plugin's `ops.ggml_dequantize` (its CUDA kernel; Triton where that lacks the type), else
    `vllm._custom_ops.ggml_dequantize` of a vLLM with in-tree GGUF. Types it never dequantizes are
    Unsupported (`dequant_gate`). Raises KernelUnavailable saying why it cannot run."""
    import importlib

    from ..kernel_errors import KernelUnavailable

    if not device.startswith("cuda"):
        raise KernelUnavailable("vllm: its GGUF dequant kernels run on CUDA only (use --device cuda); vLLM for CPU "
                                "runs no GGUF model")
    op, tables, why = None, None, []
    for ops_name, tables_name in _GGUF_OPS:
        try:
            op = getattr(importlib.import_module(ops_name), "ggml_dequantize", None)
            if op is not None:
                tables = importlib.import_module(tables_name)
                break
            why.append(f"{ops_name} has no ggml_dequantize")
        except Exception as e:  # ImportError, or a vLLM that fails at import on this machine
            op = None
            why.append(f"{ops_name}: {type(e).__name__}: {e}")
    if op is None:
        raise KernelUnavailable(f"vllm: no GGUF dequant op (vLLM {_installed_version()}; {'; '.join(why)})")
    gate = dequant_gate(tables)

    def vllm(raw, qtype: int, shape: tuple[int, ...], dtype=None):
        import torch

        gate(qtype)
        rows = 1
        for s in shape[:-1]:
            rows *= s
        # vLLM's GGUF linear layers call it with the 2-D [rows, bytes per row] weight, m rows, n columns.
        return op(raw.view(rows, -1), qtype, rows, shape[-1], dtype or torch.float16).reshape(shape)

    return vllm


def refuse(backend: Any, dtype: Any, head_size: int) -> None:
    """Unsupported, quoting vLLM's own list, when the attention backend class `backend` does not take
    this dtype or head size (`supported_dtypes`, `supports_head_size`)."""
    from ..kernel_errors import Unsupported

    name = backend.get_name()
    if not backend.supports_dtype(dtype):
        takes = ", ".join(str(d).removeprefix("torch.") for d in backend.supported_dtypes)
        raise Unsupported(f"vllm {name} takes {takes}, not {str(dtype).removeprefix('torch.')} "
                          f"({backend.__name__}.supported_dtypes)")
    if not backend.supports_head_size(head_size):
        raise Unsupported(f"vllm {name} does not take head size {head_size} ({backend.__name__}.supports_head_size; "
                          f"listed: {backend.get_supported_head_sizes() or 'a rule'})")


def kernel_block_size(sizes: list[Any], block_size: int) -> int:
    """The page size a kernel runs with: `block_size` when the backend's `get_supported_kernel_block_sizes()`
    takes it (an int exactly, a MultipleOf by its `base`), else the first size it names."""
    for s in sizes:
        base = getattr(s, "base", None)
        if (base is not None and block_size % base == 0) or s == block_size:
            return block_size
    return getattr(sizes[0], "base", sizes[0])


def repage(kv_cache, block_table, seq_lens, block_size: int):
    """The same paged latent cache in pages of `block_size`: kv_cache [N, bs, D], block_table [B, W] int32,
    seq_lens [B] -> (cache [N', block_size, D], table [B, W'] int32). Pages are handed out last-first (no
    table is the identity); page 0, the pad of every table row, and each last page's tail hold NaN, as the
    contract's caches do. Unchanged when `block_size` is the cache's own."""
    import torch

    old, width = kv_cache.shape[1], kv_cache.shape[2]
    if old == block_size:
        return kv_cache, block_table
    lens = [int(s) for s in seq_lens.tolist()]
    pages = [-(-s // block_size) for s in lens]
    cache = torch.full((sum(pages) + 1, block_size, width), float("nan"), dtype=kv_cache.dtype,
                       device=kv_cache.device)
    table = torch.zeros(len(lens), max(pages + [1]), dtype=torch.int32, device=block_table.device)
    at = cache.shape[0]
    for b, s in enumerate(lens):
        rows = kv_cache[block_table[b, : -(-s // old)].long()].reshape(-1, width)[:s]  # [s, D]
        for p in range(pages[b]):
            at -= 1
            chunk = rows[p * block_size:(p + 1) * block_size]
            cache[at, : chunk.shape[0]] = chunk
            table[b, p] = at
    return cache, table


def fit_pages(backend: Any, kv_cache, block_table, seq_lens):
    """(cache, table) in a page size the backend's kernel takes (`repage` when the case's is not one)."""
    bs = kernel_block_size(backend.get_supported_kernel_block_sizes(), kv_cache.shape[1])
    return repage(kv_cache, block_table, seq_lens, bs)


def request_of_rows(cu_seqlens_q):
    """int32 [Tq]: the sequence each query row belongs to (vLLM's req_id_per_token)."""
    import torch

    lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    return torch.repeat_interleave(torch.arange(len(lens), device=cu_seqlens_q.device), lens).to(torch.int32)


def pad_topk(topk, multiple: int):
    """topk [Tq, K] with -1 columns appended up to a multiple of `multiple` (vLLM's indexer buffer holds
    index_topk columns, -1 past the picks; its index conversion takes tiles of 128)."""
    import torch

    extra = -topk.shape[1] % multiple
    return torch.nn.functional.pad(topk, (0, extra), value=-1) if extra else topk


def pad_heads(q, multiple: int):
    """q [T, H, D] with zero heads appended up to `multiple` (FlashMLA's sparse kernel takes 64 heads on
    Hopper, 128 on Blackwell; vLLM pads when H divides that, as here). Unsupported otherwise."""
    import torch

    from ..kernel_errors import Unsupported

    h = q.shape[1]
    if h % multiple == 0:
        return q
    if multiple % h:
        raise Unsupported(f"vllm FLASHMLA_SPARSE: {h} heads neither a multiple nor a divisor of {multiple}")
    return torch.cat([q, q.new_zeros(q.shape[0], multiple - h, q.shape[2])], dim=1)


def triton_mla_splits(max_seq_len: int, sm_count: int) -> int:
    """TRITON_MLA's key splits: max(1, max_seq_len // 512) rounded up to a power of two, at most twice the
    SM count (vLLM 0.24 TritonMLAImpl.forward_mqa)."""
    ideal = max(1, max_seq_len // 512)
    return min(1 << (ideal - 1).bit_length(), 2 * sm_count)


def attention_kernels(device: str) -> dict[str, Callable]:
    """`vllm` under check attention's prefill contract: on CUDA vLLM's varlen FlashAttention
    (`vllm.vllm_flash_attn.flash_attn_varlen_func`, in this process) in the version vLLM itself picks
    (`fa_utils.get_flash_attn_version`: FA3 on Hopper; the function's own default is FA2, which takes no
    Dv != Dqk such as MLA's prefill 192/128); on the CPU its CPU_ATTN kernel, run by the driver in the
    `python` on PATH that imports vllm (`cpu_attention`). Raises KernelUnavailable saying why neither runs."""
    from ..kernel_errors import KernelUnavailable, Unsupported

    if not device.startswith("cuda"):
        python, why = default_python_or_reason()
        if python is None:
            raise KernelUnavailable(f"vllm: {why}")
        return {"prefill": cpu_attention(python)}
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:
        raise KernelUnavailable(f"vllm: not installed beside llmdoctor ({type(e).__name__}: {e}); vLLM's CPU "
                                "attention runs inside its engine only (diagnose --engine vllm)") from None

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1, softcap=0.0):
        refuse(FlashAttentionBackend, q.dtype, q.shape[-1])
        version = get_flash_attn_version(head_size=q.shape[-1], head_size_v=v.shape[-1])
        if version is None:
            raise Unsupported("vllm FLASH_ATTN: no FlashAttention version runs on this GPU")
        if version == 2 and v.shape[-1] != q.shape[-1]:
            raise Unsupported(f"vllm FLASH_ATTN: FA2 needs Dv == Dqk, got {q.shape[-1]}/{v.shape[-1]}")
        # vLLM passes a sliding window W as window_size [W - 1, 0] (the contract's window_left, 0)
        window = [window_left, 0] if window_left >= 0 else None
        return flash_attn_varlen_func(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k=cu_seqlens_k,
                                      softmax_scale=softmax_scale, causal=causal, window_size=window, softcap=softcap,
                                      return_softmax_lse=True, fa_version=version)

    return {"prefill": prefill}


def mla_kernels(device: str, which: str) -> dict[str, Callable]:
    """vLLM's MLA kernel `which` (check attention's subject `vllm-<which>`) under the MLA contracts, CUDA only,
    each called as its vLLM 0.24 backend calls it on a bf16/fp16 latent cache [pages, bs, R + Dr]:
      flashmla       FLASHMLA's `flash_mla_with_kvcache` (dense decode, pages of 64) and, for the sparse
                     contracts, FLASHMLA_SPARSE's bf16-cache path: vLLM's own index conversion
                     (`triton_convert_req_index_to_global_index`) then `flash_mla_sparse_fwd` (its decode
                     kernel reads the fp8_ds_mla cache only); returns out only there (vLLM uses no lse)
      flashattn-mla  FLASH_ATTN_MLA: FA3 varlen with q_v (the latent part of q) over the paged cache
      triton-mla     TRITON_MLA's `decode_attention_fwd` with vLLM's split count; takes an fp8 cache
                     (kv_scale=) as vLLM's does; lse in float32 (vLLM keeps it in q's dtype, for its
                     context-parallel merge only)
    Raises KernelUnavailable saying why it cannot run here."""
    from ..kernel_errors import KernelUnavailable

    label = f"vllm-{which}"
    if not device.startswith("cuda"):
        raise KernelUnavailable(f"{label}: vLLM's MLA kernels run on CUDA only (use --device cuda)")
    try:
        return {"flashmla": _flashmla, "flashattn-mla": _flashattn_mla, "triton-mla": _triton_mla}[which](label)
    except ImportError as e:
        raise KernelUnavailable(f"{label}: vLLM {_installed_version()} lacks it here ({e})") from None


def _flashmla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.sparse_utils import triton_convert_req_index_to_global_index
    from vllm.v1.attention.ops import flashmla as ops

    from ..kernel_errors import KernelUnavailable

    kernels: dict[str, Callable] = {}
    dense_ok, dense_why = ops.is_flashmla_dense_supported()
    sparse_ok, sparse_why = ops.is_flashmla_sparse_supported()
    if not (dense_ok or sparse_ok):
        raise KernelUnavailable(f"{label}: {dense_why}; sparse: {sparse_why}")
    if dense_ok:
        def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
            refuse(FlashMLABackend, q.dtype, q.shape[-1])
            cache, table = fit_pages(FlashMLABackend, kv_cache, block_table, seq_lens)
            meta, _ = ops.get_mla_metadata()
            # q [B, 1, H, R + Dr] (one query per sequence), cache [pages, 64, 1, R + Dr] (one latent head)
            out, lse = ops.flash_mla_with_kvcache(q[:, None].contiguous(), cache.unsqueeze(-2), table, seq_lens,
                                                  kv_lora_rank, meta, softmax_scale=softmax_scale, causal=True,
                                                  is_fp8_kvcache=False)
            return out[:, 0], lse[:, :, 0].transpose(0, 1)  # [B, H, R], lse [B, H, 1] -> [H, B]

        kernels["mla-decode"] = mla_decode
    if sparse_ok:
        heads = 128 if current_platform.is_device_capability_family(100) else 64

        def sparse(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
            refuse(FlashMLASparseBackend, q.dtype, q.shape[-1])
            cache, table = fit_pages(FlashMLASparseBackend, kv_cache, block_table, seq_lens)
            picks = pad_topk(topk_indices, 128)
            slots, counts = triton_convert_req_index_to_global_index(
                request_of_rows(cu_seqlens_q), table, picks, BLOCK_SIZE=cache.shape[1], NUM_TOPK_TOKENS=picks.shape[1],
                return_valid_counts=True)
            out = ops.flash_mla_sparse_fwd(pad_heads(q, heads), cache.view(-1, 1, cache.shape[-1]),
                                           slots.view(q.shape[0], 1, -1), softmax_scale, d_v=kv_lora_rank,
                                           topk_length=counts)[0]
            return out[:, : q.shape[1]]

        def mla_sparse_decode(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
            cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            return sparse(q, kv_cache, block_table, cu, seq_lens, topk_indices, softmax_scale, kv_lora_rank)

        def mla_sparse_prefill(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale,
                               kv_lora_rank):
            return sparse(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale, kv_lora_rank)

        kernels |= {"mla-sparse-decode": mla_sparse_decode, "mla-sparse-prefill": mla_sparse_prefill}
    return kernels


def _flashattn_mla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.v1.attention.backends.fa_utils import flash_attn_supports_mla
    from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ..kernel_errors import KernelUnavailable

    if not flash_attn_supports_mla():
        raise KernelUnavailable(f"{label}: FlashAttention MLA needs FA3 on a compute capability 9.x GPU "
                                "(fa_utils.flash_attn_supports_mla)")

    def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank):
        refuse(FlashAttnMLABackend, q.dtype, q.shape[-1])
        cache, table = fit_pages(FlashAttnMLABackend, kv_cache, block_table, seq_lens)
        r = kv_lora_rank
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        # q_pe against k_pe plus q_nope (q_v) against the latent, which is also the value: one MQA head
        return flash_attn_varlen_func(q=q[..., r:], k=cache[..., r:].unsqueeze(-2), v=cache[..., :r].unsqueeze(-2),
                                      q_v=q[..., :r], max_seqlen_q=1, cu_seqlens_q=cu,
                                      max_seqlen_k=int(seq_lens.max()), seqused_k=seq_lens, block_table=table,
                                      softmax_scale=softmax_scale, causal=True, return_softmax_lse=True, fa_version=3)

    return {"mla-decode": mla_decode}


def _triton_mla(label: str) -> dict[str, Callable]:
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend
    from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd

    from ..kernel_errors import Unsupported

    sm_count = current_platform.num_compute_units()

    def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, kv_scale=None):
        refuse(TritonMLABackend, q.dtype, q.shape[-1])
        if kv_scale is not None and not TritonMLABackend.supports_kv_cache_dtype("fp8"):
            raise Unsupported("vllm TRITON_MLA: no fp8 cache (TritonMLABackend.supported_kv_cache_dtypes)")
        cache, table = fit_pages(TritonMLABackend, kv_cache, block_table, seq_lens)
        b, h, r = q.shape[0], q.shape[1], kv_lora_rank
        splits = triton_mla_splits(int(seq_lens.max()), sm_count)
        out = q.new_zeros(b, h, r)  # [B, H, R]
        lse = torch.zeros(b, h, dtype=torch.float32, device=q.device)  # [B, H]
        logits = torch.empty(b, h, splits, r + 1, dtype=torch.float32, device=q.device)  # partials + their lse
        scale = torch.tensor(1.0 if kv_scale is None else float(kv_scale), dtype=torch.float32, device=q.device)
        k4 = cache.unsqueeze(2)  # [pages, bs, 1, R + Dr]: one latent head
        decode_attention_fwd(q.contiguous(), k4, k4[..., :r], out, lse, table, seq_lens, logits, splits,
                             softmax_scale, cache.shape[1], k_scale=scale, v_scale=scale, is_mla=True)
        return out, lse.transpose(0, 1)

    return {"mla-decode": mla_decode}


def cpu_attention(python: str) -> Callable:
    """The prefill contract on vLLM's CPU attention kernel: each call runs the driver's `attention`
    (a paged cache filled as vLLM's CPU backend fills it); returns out only (the kernel gives no lse).
    A head size or dtype the kernel does not take raises Unsupported (skipped with its list)."""
    import torch

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
        with tempfile.TemporaryDirectory(prefix="llmdoctor-vllm-attn-") as tmp:
            path = Path(tmp) / "qkv.pt"
            torch.save({"q": q.contiguous(), "k": k.contiguous(), "v": v.contiguous(), "cu_q": cu_seqlens_q.cpu(),
                        "cu_k": cu_seqlens_k.cpu()}, path)
            res = _call(python, {"command": "attention", "tensors": str(path), "scale": float(softmax_scale),
                                 "causal": bool(causal)}, QUERY_TIMEOUT_S)
        return res["out"]

    return prefill
