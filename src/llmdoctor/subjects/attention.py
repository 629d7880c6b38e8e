"""Attention subjects: the kernel contracts of `llmdoctor check attention`, built-in adapters, the
handler that serves one subject in an isolated child (`subjects.isolation.Isolated`) and its client
(`IsolatedAttention`, what the check's caller hands it), and the engine's own backend selection.

Contracts (issue 6; semantics, with their sources, in reference/attention_cases.py: causal =
bottom-right, a row with no visible key gives 0 and an infinite lse, seq_lens include the current
token, topk rows are what DSA indexers emit: distinct local positions up to the query's own, -1 pads):
    prefill            fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal)
    mla-decode         fn(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank)
    mla-sparse-decode  fn(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank)
    mla-sparse-prefill fn(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale, kv_lora_rank)
Each returns out, or (out, lse) with lse [H, total_q] in natural log. Optional keywords (window_left,
softcap, out=) are passed only when a case needs them and the function's signature takes them.

Built-ins: torch SDPA with one backend forced (`sdpa-math`, `sdpa-flash`, `sdpa-efficient`,
`sdpa-cudnn`), `flex` (flex_attention: eager on CPU, compiled on CUDA), and adapters for `flash-attn`,
`flashinfer`, `vllm` (its dense kernel) and vLLM's MLA kernels (`vllm-flashmla`, `vllm-flashattn-mla`,
`vllm-triton-mla`; `--subjects vllm` names them all) that load only where those packages are installed. The adapters implement the
contract's conventions themselves (gathering pages, the top-k set, the bottom-right mask) without the
reference's code, so a shared mistake cannot hide. What each one cannot take (a head size, a mask) it
reports as `Unsupported`: skipped with the reason, not failed.
"""

from __future__ import annotations

import inspect
import io
import time
import warnings
import zlib
from typing import Any, Callable, Optional

import torch

from ..errors import InputError
from ..outcomes import AttentionReply
from .isolation import Isolated
from .kernels import KernelUnavailable, Unsupported, load as load_spec, validate_spec

CONTRACTS: dict[str, tuple[str, ...]] = {
    "prefill": ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
                "causal"),
    "mla-decode": ("q", "kv_cache", "block_table", "seq_lens", "softmax_scale", "kv_lora_rank"),
    "mla-sparse-decode": ("q", "kv_cache", "block_table", "seq_lens", "topk_indices", "softmax_scale",
                          "kv_lora_rank"),
    "mla-sparse-prefill": ("q", "kv_cache", "block_table", "cu_seqlens_q", "seq_lens", "topk_indices",
                           "softmax_scale", "kv_lora_rank"),
}
SDPA_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                 "sdpa-cudnn": "CUDNN_ATTENTION"}
# vLLM's MLA kernels, one subject each, with the contracts each offers (subjects/engines/vllm_kernels.py mla_kernels)
VLLM_MLA: dict[str, tuple[str, ...]] = {"vllm-flashmla": ("mla-decode", "mla-sparse-decode", "mla-sparse-prefill"),
                                        "vllm-flashattn-mla": ("mla-decode",), "vllm-triton-mla": ("mla-decode",)}
BUILTINS = (*SDPA_BACKENDS, "flex", "flash-attn", "flashinfer", "vllm", *VLLM_MLA)
# a name that stands for several subjects (`--subjects vllm`: its dense kernel and its MLA kernels)
GROUPS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", *VLLM_MLA)}


def builtin_subjects(names: str, contracts: Optional[set[str]] = None) -> list[tuple[str, Optional[str]]]:
    """(name, None) per built-in of --subjects: all | a comma list of built-in names (a group name stands for
    its members). With `contracts` (those a shape's cases call), a built-in whose contracts are fixed
    (vLLM's MLA kernels) is left out where it offers none of them."""
    if names == "all":
        picked = list(BUILTINS)
    else:
        picked = []
        for n in (n.strip() for n in names.split(",") if n.strip()):
            if n not in BUILTINS:
                raise InputError(f"--subjects {n!r}: expected all or some of {', '.join(BUILTINS)}")
            picked += [m for m in GROUPS.get(n, (n,)) if m not in picked]
    return [(n, None) for n in picked if contracts is None or n not in VLLM_MLA or contracts & set(VLLM_MLA[n])]


# ----------------------------------------------------------------------------- shared adapter pieces

def _rows(kv_cache: torch.Tensor, block_row: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0..n-1 of one sequence's paged cache [num_blocks, bs, D] -> [n, D]."""
    bs = kv_cache.shape[1]
    return kv_cache[block_row[: (n + bs - 1) // bs].long()].flatten(0, 1)[:n]


def _picked(topk_row: torch.Tensor, last: int) -> torch.Tensor:
    """The distinct valid positions <= last named in one query's top-k row (int64, sorted)."""
    return topk_row[(topk_row >= 0) & (topk_row <= last)].long().unique()


def _latent_rows(q_rows: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, cu_q: list[int],
                 seq_lens: list[int], topk: torch.Tensor | None) -> list[tuple[int, torch.Tensor]]:
    """(query row, cache rows it attends [S_i, R+Dr]) for each query of a paged latent cache."""
    work = []
    for b, s in enumerate(seq_lens):
        rows = _rows(kv_cache, block_table[b], s)
        t = cu_q[b + 1] - cu_q[b]
        for i in range(t):
            last = s - t + i  # bottom-right: this query's own position
            r = cu_q[b] + i
            work.append((r, rows[_picked(topk[r], last)] if topk is not None else rows[: last + 1]))
    return work


# ----------------------------------------------------------------------------- torch SDPA

# Messages with which torch says a forced backend or a compiled kernel cannot take this shape (a skip,
# not a failure): SDPA's dispatcher, cuDNN's frontend, Triton's shared-memory check (compiled flex on
# 576/512 asks for more than the H200's 232,448 B, issue 6).
_CANNOT_RUN = ("No available kernel", "No valid execution plans", "cuDNN Frontend error", "out of resource")


def _why(messages: Any) -> str:
    """The informative lines of torch's warnings / errors: no 'X not used because:' headers, no notes
    that the other backends are disabled (we disabled them), no pointers to verbose logging."""
    keep: list[str] = []
    for m in messages:
        for line in m.splitlines():
            line = line.split(" (Triggered internally")[0].strip()
            if (not line or line.endswith("because:") or "has been disabled" in line or "TORCHDYNAMO_VERBOSE" in line
                    or "TORCH_LOGS" in line or line in keep):
                continue
            keep.append(line)
    hit = [k for k in keep if any(c in k for c in _CANNOT_RUN)]
    return "; ".join(hit or keep)[:300]

def _sdpa(backend_name: str, device: str) -> dict[str, Callable]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    backend = getattr(SDPBackend, SDPA_BACKENDS[backend_name])

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kw: Any) -> torch.Tensor:
        """q [H, T, D], k [H, S, D], v [H, S, Dv] -> [H, T, Dv] with the backend forced."""
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel(backend):
            warnings.simplefilter("always")
            try:
                return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, **kw)[0]
            except RuntimeError as e:
                if not any(m in str(e) for m in _CANNOT_RUN):
                    raise
                why = _why(str(w.message) for w in caught)
                raise Unsupported(f"{backend_name} cannot run q {tuple(q.shape)} k {tuple(k.shape)} "
                                  f"v {tuple(v.shape)}: {why or e}") from None

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1):
        g = q.shape[1] // k.shape[1]
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])  # [Tq, H, Dv]
        for b in range(len(cq) - 1):
            qs = q[cq[b]:cq[b + 1]].transpose(0, 1)  # [H, t, D]
            ks = k[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(g, 0)  # [H, s, D]
            vs = v[ck[b]:ck[b + 1]].transpose(0, 1).repeat_interleave(g, 0)  # [H, s, Dv]
            t, s = qs.shape[1], ks.shape[1]
            if t == 0:
                continue
            kw: dict[str, Any] = {}
            if window_left >= 0 and causal:  # sliding window: an explicit boolean mask
                qp = torch.arange(t, device=q.device)[:, None] + (s - t)
                kp = torch.arange(s, device=q.device)[None, :]
                kw["attn_mask"] = (kp <= qp) & (qp - kp <= window_left)
            elif causal and t == s:
                kw["is_causal"] = True  # top-left == bottom-right when q_len == k_len
            elif causal and t > 1:
                kw["attn_mask"] = causal_lower_right(t, s)  # SDPA's is_causal is top-left: not this
            out[cq[b]:cq[b + 1]] = call(qs, ks, vs, softmax_scale, **kw).transpose(0, 1)
        return out

    def latent(q, kv_cache, block_table, cu_q, seq_lens, topk, softmax_scale, kv_lora_rank):
        out = q.new_zeros(q.shape[0], q.shape[1], kv_lora_rank)  # [Tq, H, R]
        for r, rows in _latent_rows(q, kv_cache, block_table, cu_q, seq_lens, topk):
            if rows.shape[0] == 0:
                continue
            k = rows[None].expand(q.shape[1], -1, -1)  # [H, S, R+Dr]: MQA as MHA over one shared head
            out[r] = call(q[r][:, None], k, k[..., :kv_lora_rank], softmax_scale)[:, 0]
        return out

    return _mla_entry_points(latent) | {"prefill": prefill}


def _mla_entry_points(latent: Callable) -> dict[str, Callable]:
    """The three MLA contracts on top of one `latent(q, cache, table, cu_q, seq_lens, topk, scale, R)`.
    An fp8 cache (kv_scale=) is dequantized to q's dtype first, as engines without fp8 attention do."""

    def mla_decode(q, kv_cache, block_table, seq_lens, softmax_scale, kv_lora_rank, kv_scale=None):
        if kv_scale is not None:
            kv_cache = kv_cache.to(q.dtype) * kv_scale
        return latent(q, kv_cache, block_table, list(range(q.shape[0] + 1)), seq_lens.tolist(), None,
                      softmax_scale, kv_lora_rank)

    def mla_sparse_decode(q, kv_cache, block_table, seq_lens, topk_indices, softmax_scale, kv_lora_rank):
        return latent(q, kv_cache, block_table, list(range(q.shape[0] + 1)), seq_lens.tolist(), topk_indices,
                      softmax_scale, kv_lora_rank)

    def mla_sparse_prefill(q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk_indices, softmax_scale,
                           kv_lora_rank):
        return latent(q, kv_cache, block_table, cu_seqlens_q.tolist(), seq_lens.tolist(), topk_indices,
                      softmax_scale, kv_lora_rank)

    return {"mla-decode": mla_decode, "mla-sparse-decode": mla_sparse_decode,
            "mla-sparse-prefill": mla_sparse_prefill}


# ----------------------------------------------------------------------------- flex_attention

def _flex(device: str) -> dict[str, Callable]:
    """flex_attention over a dense boolean mask of the packed batch; returns (out, lse).

    Eager on CPU (compiling costs 30-40 s per shape and dtype on 2 cores, issue 6); compiled on CUDA,
    with the packed lengths padded to multiples of 128 so that cases share compiled kernels."""
    from torch.nn.attention import flex_attention as fa

    flex = torch.compile(fa.flex_attention, dynamic=False) if device.startswith("cuda") else fa.flex_attention
    warnings.filterwarnings("ignore", message=".*without torch.compile.*")  # eager on the CPU is the choice
    warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")  # older torch: no AuxRequest
    pad = 128 if device.startswith("cuda") else 1
    aux = getattr(fa, "AuxRequest", None)

    def run(q, k, v, allowed, scale, softcap=0.0):
        """q [Tq, H, D], k [Tk, Hk, D], v [Tk, Hk, Dv], allowed bool [Tq, Tk] -> out, lse [H, Tq]."""
        tq, tk = q.shape[0], k.shape[0]
        pq, pk = -(-max(tq, 1) // pad) * pad, -(-max(tk, 1) // pad) * pad
        mask = torch.zeros(pq, pk, dtype=torch.bool, device=q.device)
        mask[:tq, :tk] = allowed

        def padded(x, n):
            return torch.nn.functional.pad(x, (0, 0, 0, 0, 0, n - x.shape[0])).transpose(0, 1)[None].contiguous()

        block = fa.create_block_mask(lambda b, h, qi, kj: mask[qi, kj], None, None, pq, pk, device=q.device)
        score_mod = (lambda s, b, h, qi, kj: softcap * torch.tanh(s / softcap)) if softcap else None
        kw = {"return_aux": aux(lse=True)} if aux else {"return_lse": True}
        try:
            o, extra = flex(padded(q, pq), padded(k, pk), padded(v, pk), score_mod=score_mod, block_mask=block,
                            scale=scale, enable_gqa=k.shape[1] != q.shape[1], **kw)
        except Exception as e:  # compile errors come wrapped in several classes
            if not any(m in str(e) for m in _CANNOT_RUN):
                raise
            raise Unsupported(f"flex cannot compile q {tuple(q.shape)} v {tuple(v.shape)}: "
                              f"{_why([str(e)])}") from None
        lse = extra.lse if aux else extra
        return o[0, :, :tq].transpose(0, 1), lse[0, :, :tq]

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1, softcap=0.0):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device)
        for b in range(len(cq) - 1):
            t, s = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
            qp = torch.arange(t, device=q.device)[:, None] + (s - t)
            kp = torch.arange(s, device=q.device)[None, :]
            ok = (kp <= qp) if causal else torch.ones(t, s, dtype=torch.bool, device=q.device)
            if causal and window_left >= 0:
                ok &= qp - kp <= window_left
            allowed[cq[b]:cq[b + 1], ck[b]:ck[b + 1]] = ok
        return run(q, k, v, allowed, softmax_scale, softcap)

    def latent(q, kv_cache, block_table, cu_q, seq_lens, topk, softmax_scale, kv_lora_rank):
        work = _latent_rows(q, kv_cache, block_table, cu_q, seq_lens, topk)
        keys = torch.cat([rows for _, rows in work]) if work else kv_cache.new_zeros(0, kv_cache.shape[2])
        allowed = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.bool, device=q.device)
        at = 0
        for r, rows in work:  # each query sees its own gathered rows only
            allowed[r, at:at + rows.shape[0]] = True
            at += rows.shape[0]
        out, lse = run(q, keys[:, None], keys[:, None, :kv_lora_rank], allowed, softmax_scale)
        return out, lse

    return _mla_entry_points(latent) | {"prefill": prefill}


# ----------------------------------------------------------------------------- optional libraries
# Untested here: none of these packages is installed on this machine or on the H200 (issue 6).

def _flash_attn(device: str) -> dict[str, Callable]:
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as e:  # ImportError, or a build for another torch
        raise KernelUnavailable(f"flash-attn: not installed ({type(e).__name__}: {e})") from None
    if not device.startswith("cuda"):
        raise KernelUnavailable("flash-attn: CUDA only (use --device cuda)")

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1, softcap=0.0):
        # flash-attn >= 2.1 aligns causal bottom-right, as the contract; its lse is [H, Tq], natural log.
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                             softmax_scale=softmax_scale, causal=causal,
                                             window_size=(window_left, 0 if window_left >= 0 else -1),
                                             softcap=softcap, return_attn_probs=True)
        return out, lse

    return {"prefill": prefill}


def _flashinfer(device: str) -> dict[str, Callable]:
    try:
        import flashinfer
    except Exception as e:
        raise KernelUnavailable(f"flashinfer: not installed ({type(e).__name__}: {e})") from None
    if not device.startswith("cuda"):
        raise KernelUnavailable("flashinfer: CUDA only (use --device cuda)")
    ln2 = 0.6931471805599453

    def prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                window_left=-1, softcap=0.0):
        cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2])
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
        for b in range(len(cq) - 1):
            if cq[b + 1] == cq[b] or ck[b + 1] == ck[b]:
                continue
            o, l = flashinfer.single_prefill_with_kv_cache(
                q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal=causal, sm_scale=softmax_scale,
                window_left=window_left, logits_soft_cap=softcap or None, return_lse=True)
            out[cq[b]:cq[b + 1]] = o
            # FlashInfer's lse is [q_len, H] in base 2 (flashinfer issue #2113; prefill wrappers default
            # lse_base="log2", PR #5257): to the contract's [H, q_len] natural log
            lse[:, cq[b]:cq[b + 1]] = l.float().transpose(0, 1) * ln2
        return out, lse

    return {"prefill": prefill}


def _vllm(device: str) -> dict[str, Callable]:
    from .engines import vllm_kernels as vllm

    return vllm.attention_kernels(device)


def _vllm_mla(name: str, device: str) -> dict[str, Callable]:
    from .engines import vllm_kernels as vllm

    return vllm.mla_kernels(device, name.removeprefix("vllm-"))


_LOADERS: dict[str, Callable[[str], dict[str, Callable]]] = {
    **{name: (lambda device, name=name: _sdpa(name, device)) for name in SDPA_BACKENDS},
    "flex": _flex, "flash-attn": _flash_attn, "flashinfer": _flashinfer, "vllm": _vllm,
    **{name: (lambda device, name=name: _vllm_mla(name, device)) for name in VLLM_MLA},
}


def load(spec: str, device: str, contract: str | None = None) -> dict[str, Callable]:
    """contract name -> function for a built-in, or {contract: fn} for a `module:function` spec."""
    if spec in _LOADERS:
        if spec in ("sdpa-efficient", "sdpa-cudnn") and not device.startswith("cuda"):
            # torch's CPU SDPA has the MATH and FLASH backends only (measured, issue 6)
            raise KernelUnavailable(f"{spec}: torch has this SDPA backend on CUDA only")
        return _LOADERS[spec](device)
    if contract not in CONTRACTS:
        raise KernelUnavailable(f"{spec}: a user kernel needs --contract ({', '.join(CONTRACTS)})")
    validate_spec(spec, flag="--impl")
    return {contract: load_spec(spec, device, flag="--impl")}


# ----------------------------------------------------------------------------- serving in a child

def pack(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes | bytearray) -> Any:
    return torch.load(io.BytesIO(bytes(data)), weights_only=True)


def _params(fn: Callable) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return {}


def _takes(fn: Callable, name: str) -> bool:
    params = _params(fn)
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def serve(spec: str, device: str, contract: str | None) -> Callable:
    """Handler factory for `Isolated`: load the subject once, then run one contract call per request.

    Request header: contract, out_shape, lse_shape, crc32 of the payload; payload: pack({"args": [...],
    "kwargs": {...}}) with tensors on the CPU. Reply payload: pack({"out": out, "lse": lse or None}) on the
    CPU with its crc32 in the header, plus the status 'unsupported' (skip), 'contract' (a violation: wrong
    type or shape) or 'transport' (the request's bytes arrived changed: no verdict either way).
    """
    fns = load(spec, device, contract)
    if device.startswith("cuda"):
        torch.zeros(1, device=device)

    def handle(header: dict, payload: bytearray) -> tuple[dict, Any]:
        fn = fns.get(header["contract"])
        if fn is None:
            return {"status": "unsupported", "message": f"{spec} has no {header['contract']} kernel"}, b""
        if "crc32" in header and zlib.crc32(payload) != header["crc32"]:
            return {"status": "transport", "message": "the request's bytes arrived changed (crc32 differs)"}, b""
        req = unpack(payload)
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in req["args"]]
        kwargs = dict(req["kwargs"])
        for name in kwargs:
            if not _takes(fn, name):
                return {"status": "unsupported", "message": f"{spec} does not take {name}="}, b""
        out_buf = None
        if "out" in _params(fn):  # named explicitly: a **kwargs catch-all is not an out= promise
            out_buf = torch.full(header["out_shape"], float("nan"), dtype=args[0].dtype, device=device)
            kwargs["out"] = out_buf
        t0 = time.perf_counter()
        try:
            res = fn(*args, **kwargs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
        except NotImplementedError as e:
            return {"status": "unsupported", "message": str(e) or "NotImplementedError"}, b""
        seconds = time.perf_counter() - t0
        out, lse = res if isinstance(res, tuple) else (res, None)
        if out is None:
            out = out_buf
        problem = _violation(out, tuple(header["out_shape"]), "out") or (
            lse is not None and _violation(lse, tuple(header["lse_shape"]), "lse"))
        if problem:
            return {"status": "contract", "message": problem}, b""
        data = pack({"out": out.detach().cpu(), "lse": None if lse is None else lse.detach().float().cpu()})
        return ({"status": "ok", "seconds": seconds, "dtype": str(out.dtype).removeprefix("torch."),
                 "crc32": zlib.crc32(data)}, data)

    return handle


class IsolatedAttention:
    """The attention subject `spec` (under `contract`: a user kernel's; None: a built-in's own) served in an
    isolated child (`serve`). Context manager; `start` raises LoadFailed when the child cannot load it."""

    def __init__(self, spec: str, contract: Optional[str], *, device: str = "cpu", timeout: float = 300.0):
        self._iso = Isolated("llmdoctor.subjects.attention:serve", (spec, device, contract), call_timeout=timeout)

    def __enter__(self) -> "IsolatedAttention":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self._iso.start()

    def close(self) -> None:
        self._iso.close()

    @property
    def restarts(self) -> int:
        """Fresh children started after a crash or hang."""
        return self._iso.restarts

    def call(self, contract: str, args: list[Any], kwargs: dict[str, Any], out_shape: tuple[int, ...],
             lse_shape: tuple[int, ...]) -> AttentionReply:
        """One contract call; tensors travel through the CPU and come back on the device of the first
        tensor in `args`. The bytes are checked by crc32 both ways: a verdict needs intact bytes."""
        dev = next(a.device for a in args if isinstance(a, torch.Tensor))
        args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        payload = pack({"args": args, "kwargs": kwargs})
        r = self._iso.call({"contract": contract, "out_shape": list(out_shape), "lse_shape": list(lse_shape),
                            "crc32": zlib.crc32(payload)}, payload)
        if r.status != "ok":
            return AttentionReply(r.status, r.message, seconds=r.seconds)
        if zlib.crc32(r.payload) != r.header.get("crc32"):
            return AttentionReply("transport", "the reply's bytes arrived changed (crc32 differs)", seconds=r.seconds)
        res = unpack(r.payload)
        lse = None if res["lse"] is None else res["lse"].to(dev)
        return AttentionReply("ok", out=res["out"].to(dev), lse=lse, seconds=r.header.get("seconds", r.seconds))


def engine_backends(head_size: int, dtype: str, *, use_mla: bool, use_sparse: bool) -> dict[str, Any]:
    """Which attention backends the engine that selects them at run time (vLLM) selects for this head size
    (MLA: the latent cache row) and dtype: its own selection code, asked through the engine interface;
    {"skipped": why} elsewhere."""
    from .engines import engine_class, selectable
    from .engines.base import Deployment, EngineError, EngineUnavailable

    engine = next(engine_class(n) for n in selectable() if engine_class(n).traits.selects_backends)(Deployment())
    try:
        return engine.select_backend(head_size, dtype, use_mla=use_mla, use_sparse=use_sparse)
    except EngineUnavailable as e:
        return {"skipped": f"{engine.title} is not available: {e}"}
    except EngineError as e:
        return {"skipped": f"{engine.title}'s selection could not run: {e}"}


def _violation(x: Any, shape: tuple[int, ...], what: str) -> str:
    if not isinstance(x, torch.Tensor):
        return f"{what}: returned {type(x).__name__}, not a torch.Tensor"
    if tuple(x.shape) != shape:
        return f"{what}: returned shape {tuple(x.shape)}, expected {shape}"
    if not x.is_floating_point():
        return f"{what}: returned {x.dtype}, not a floating tensor"
    return ""
