"""vLLM's own GPU kernels as subjects (issue 22 part 2): `check dequant --kernel vllm` and `check attention
--subjects vllm` (its varlen FlashAttention and its MLA kernels FlashMLA, FlashAttn MLA, Triton MLA, FlashMLA
sparse). The adapters' layout logic runs here on the CPU (page sizes, index padding, head padding, split
counts, vLLM's own type and dtype lists); the kernels themselves only on a GPU with vLLM installed beside
llmdoctor (marked `gpu`, run by bench/h200_vllm.sh on the H200).
"""

from __future__ import annotations

import types

import pytest
import torch

from llmdoctor.checks.kernels import attention as ca
from llmdoctor.checks.kernels import attention_shapes as shapes
from llmdoctor.checks.kernels.attention_suite import cases
from llmdoctor.reference.attention_cases import gather_pages
from llmdoctor.subjects import attention as subj
from llmdoctor.subjects.engines import vllm_kernels as vk
from llmdoctor.subjects.kernel_errors import KernelUnavailable, Unsupported


class MultipleOf:  # the shape of vLLM's vllm.v1.attention.backend.MultipleOf
    def __init__(self, base: int):
        self.base = base


def paged(lens: list[int], bs: int, width: int = 8, dtype=torch.float32, seed: int = 0):
    """A paged cache as check attention draws one: shuffled pages, NaN tails, a NaN page as the table pad."""
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-s // bs) for s in lens]
    n = sum(pages) + 2
    order = torch.randperm(n, generator=gen)
    cache = torch.full((n, bs, width), float("nan"))
    table = torch.full((len(lens), max(pages) + 1), int(order[-1]), dtype=torch.int32)
    at = 0
    for b, s in enumerate(lens):
        blocks = order[at:at + pages[b]]
        at += pages[b]
        table[b, :pages[b]] = blocks.to(torch.int32)
        flat = cache[blocks.long()].reshape(-1, width)
        flat[:s] = torch.randn(s, width, generator=gen)
        cache[blocks.long()] = flat.reshape(-1, bs, width)
    return cache.to(dtype), table, torch.tensor(lens, dtype=torch.int32)


# ---- the adapters' layout logic (CPU) ----------------------------------------------------------------

def test_kernel_block_size_follows_the_backends_list():
    assert vk.kernel_block_size([64], 16) == 64 and vk.kernel_block_size([64], 64) == 64  # FLASHMLA: 64 exactly
    assert vk.kernel_block_size([MultipleOf(16)], 64) == 64  # FLASH_ATTN_MLA / TRITON_MLA: multiples of 16
    assert vk.kernel_block_size([MultipleOf(16)], 8) == 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("to", [64, 32])
def test_repage_keeps_every_sequences_rows_and_its_nan_tails(dtype, to):
    lens = [1, 17, 40, 64]
    cache, table, seq_lens = paged(lens, 16, dtype=dtype)
    new, new_table = vk.repage(cache, table, seq_lens, to)
    assert new.shape[1:] == (to, 8) and new.dtype == dtype and new_table.dtype == torch.int32
    for b, s in enumerate(lens):
        want = gather_pages(cache.float(), table[b], s)
        assert torch.equal(gather_pages(new.float(), new_table[b], s), want), b
        last = new[new_table[b, (s - 1) // to].long()].float()
        assert torch.isnan(last[(s - 1) % to + 1:]).all()  # the last page's tail is never data
    assert torch.isnan(new[0].float()).all() and (new_table[0, 1:] == 0).all()  # page 0: the pad, all NaN
    assert new_table[:, 0].tolist() != list(range(len(lens)))  # pages handed out last-first
    assert vk.repage(cache, table, seq_lens, 16) == (cache, table)  # its own size: untouched


def test_request_of_rows_pad_topk_pad_heads():
    cu = torch.tensor([0, 5, 6, 18], dtype=torch.int32)
    assert vk.request_of_rows(cu).tolist() == [0] * 5 + [1] + [2] * 12
    assert vk.request_of_rows(cu).dtype == torch.int32
    topk = torch.randint(0, 9, (4, 24), dtype=torch.int32)
    padded = vk.pad_topk(topk, 128)
    assert padded.shape == (4, 128) and torch.equal(padded[:, :24], topk) and (padded[:, 24:] == -1).all()
    assert vk.pad_topk(padded, 128) is padded
    q = torch.randn(3, 16, 8)
    qp = vk.pad_heads(q, 64)
    assert qp.shape == (3, 64, 8) and torch.equal(qp[:, :16], q) and not qp[:, 16:].any()
    assert vk.pad_heads(torch.randn(2, 128, 8), 64).shape[1] == 128
    with pytest.raises(Unsupported, match="48 heads"):
        vk.pad_heads(torch.randn(2, 48, 8), 64)


def test_triton_mla_split_count_is_vllms():
    """max(1, max_seq_len // 512) to a power of two, at most twice the SM count (TritonMLAImpl.forward_mqa)."""
    assert [vk.triton_mla_splits(n, 132) for n in (37, 300, 1100, 4100)] == [1, 1, 2, 8]
    assert vk.triton_mla_splits(100_000, 2) == 4


def test_refuse_quotes_the_backends_own_lists():
    backend = type("FlashAttnMLABackend", (), {
        "supported_dtypes": [torch.float16, torch.bfloat16],
        "get_name": staticmethod(lambda: "FLASH_ATTN_MLA"),
        "supports_dtype": classmethod(lambda cls, d: d in cls.supported_dtypes),
        "get_supported_head_sizes": classmethod(lambda cls: [576]),
        "supports_head_size": classmethod(lambda cls, h: h in (576,))})
    vk.refuse(backend, torch.bfloat16, 576)
    with pytest.raises(Unsupported, match=r"FLASH_ATTN_MLA takes float16, bfloat16, not float32 "
                                          r"\(FlashAttnMLABackend.supported_dtypes\)"):
        vk.refuse(backend, torch.float32, 576)
    with pytest.raises(Unsupported, match="head size 192"):
        vk.refuse(backend, torch.bfloat16, 192)


def test_dequant_gate_skips_what_vllm_never_dequantizes():
    from gguf import GGMLQuantizationType as Q

    tables = types.ModuleType("plugin.quantization.utils")
    tables.UNQUANTIZED_TYPES = {Q.F32, Q.F16, Q.BF16}
    tables.DEQUANT_TYPES = {Q.Q4_K, Q.Q8_0}
    gate = vk.dequant_gate(tables)
    gate(int(Q.Q4_K))
    with pytest.raises(Unsupported, match=r"F32 weights are used as they are.*UNQUANTIZED_TYPES"):
        gate(int(Q.F32))
    with pytest.raises(Unsupported, match=r"no GGUF dequantizer for TQ1_0.*DEQUANT_TYPES"):
        gate(int(Q.TQ1_0))


def test_cpu_says_cuda_only():
    with pytest.raises(KernelUnavailable, match="CUDA only"):
        vk.dequant_kernel("cpu")
    for which in ("flashmla", "flashattn-mla", "triton-mla"):
        with pytest.raises(KernelUnavailable, match="CUDA only"):
            vk.mla_kernels("cpu", which)


def _contracts(shape: shapes.Shape) -> set[str]:
    """The contracts a shape's cases call (what check attention hands subjects.attention.builtin_subjects)."""
    return {c.contract for c in cases(shape)}


def test_subjects_vllm_names_the_mla_kernels_where_the_shape_has_mla():
    mla = list(subj.VLLM_MLA)
    assert subj.builtin_subjects("vllm", _contracts(shapes.PRESETS["llama-3-8b"])) == [("vllm", None)]
    assert [n for n, _ in subj.builtin_subjects("vllm", _contracts(shapes.PRESETS["deepseek-v3"]))] == ["vllm", *mla]
    assert [n for n, _ in subj.builtin_subjects("vllm,vllm-triton-mla")] == ["vllm", *mla]
    assert not set(mla) & {n for n, _ in subj.builtin_subjects("all", _contracts(shapes.PRESETS["gemma3-270m"]))}
    assert set(mla) <= {n for n, _ in subj.builtin_subjects("all", _contracts(shapes.PRESETS["glm-5"]))}


@pytest.mark.slow
def test_an_mla_kernel_on_the_cpu_is_a_load_skip_with_the_reason():
    res = ca.run(shapes.PRESETS["deepseek-v3"], [("vllm-triton-mla", None)], subj.IsolatedAttention, dtypes=("bfloat16",),
                 only={"mla-decode-b1"})
    [f] = res.findings
    assert f.status == "skip" and "CUDA only" in f.reason, f.reason


# ---- on a GPU with vLLM beside llmdoctor (bench/h200_vllm.sh) -----------------------------------------

def _vllm_here() -> None:
    try:
        import vllm  # noqa: F401
    except Exception as e:
        pytest.skip(f"skipped: vLLM is not importable beside llmdoctor ({type(e).__name__}: {e})")


def _statuses(res) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in res.findings:
        out.setdefault(f.subject, []).append(f.status)
    return out


@pytest.mark.gpu
def test_vllm_mla_kernels_pass_on_cuda():
    """Each MLA kernel vLLM 0.24 has for sm_90 passes its decode cases in bfloat16 (FlashMLA after
    re-paging to 64; Triton MLA with the fp8 cache too); float32 is a skip quoting the backend's list.
    FlashAttn MLA weighs a page's unused rows by zero, so the NaN the cases leave there reaches its output
    on mla-decode-long (bench/h200_fa_mla_probe.py on the H200, 2026-12-02: NaN as-is, none with those rows
    finite, with one split or with vLLM's own schedule): information, not a fault."""
    _vllm_here()
    shape = shapes.PRESETS["deepseek-v3"]
    only = {"mla-decode-b1", "mla-decode-ragged", "mla-decode-long", "mla-decode-fp8"}
    res = ca.run(shape, [(n, None) for n in subj.VLLM_MLA], subj.IsolatedAttention, device="cuda", dtypes=("bfloat16",),
                 only=only)
    st = _statuses(res)
    assert all("fail" not in s for s in st.values()), [(f.subject, f.target, f.reason) for f in res.findings
                                                        if f.status == "fail"]
    assert all("pass" in st[n] for n in subj.VLLM_MLA), st
    assert any(f.metrics.get("unused_rows") for f in res.findings if f.subject == "vllm-flashattn-mla"), st
    res = ca.run(shape, [("vllm-triton-mla", None)], subj.IsolatedAttention, device="cuda", dtypes=("float32",),
                 only={"mla-decode-b1"})
    assert [f.status for f in res.findings] == ["skip"] and "supported_dtypes" in res.findings[0].reason


@pytest.mark.gpu
def test_vllm_sparse_mla_passes_on_cuda():
    _vllm_here()
    res = ca.run(shapes.PRESETS["glm-5"], [("vllm-flashmla", None)], subj.IsolatedAttention, device="cuda", dtypes=("bfloat16",),
                 only={"sparse-decode", "sparse-prefill", "sparse-decode-long-keys"})
    assert [f.status for f in res.findings] == ["pass"] * 3, [(f.target, f.reason) for f in res.findings]


@pytest.mark.gpu
def test_vllm_flash_attention_takes_mla_prefill_dims_and_skips_float32():
    """FA3 (vLLM's pick on Hopper) takes DeepSeek's prefill 192/128; float32 is a skip, not a fault."""
    _vllm_here()
    shape = shapes.PRESETS["deepseek-v3"]
    res = ca.run(shape, [("vllm", None)], subj.IsolatedAttention, device="cuda", dtypes=("bfloat16",),
                 only={"batch1", "ragged", "chunked"})
    assert [f.status for f in res.findings] == ["pass"] * 3, [(f.target, f.reason) for f in res.findings]
    res = ca.run(shape, [("vllm", None)], subj.IsolatedAttention, device="cuda", dtypes=("float32",), only={"batch1"})
    assert [f.status for f in res.findings] == ["skip"] and "takes float16, bfloat16" in res.findings[0].reason


@pytest.mark.gpu
def test_vllm_dequant_on_cuda_skips_f32_and_matches_q8_0():
    _vllm_here()
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    fn = vk.dequant_kernel("cuda")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    raw = torch.from_numpy(quantize(x, Q.Q8_0).reshape(-1)).cuda()
    got = fn(raw, int(Q.Q8_0), (4, 64), dtype=torch.float32).cpu()
    want = torch.from_numpy(dequantize(quantize(x, Q.Q8_0), Q.Q8_0))
    # d (fp16) times an int8 quant, computed in half precision: one fp16 rounding of the product
    assert torch.allclose(got, want, rtol=2 ** -10, atol=0), (got - want).abs().max()
    with pytest.raises(Unsupported, match="used as they are"):
        fn(torch.from_numpy(x.view(np.uint8).reshape(-1)).cuda(), int(Q.F32), (4, 64))
