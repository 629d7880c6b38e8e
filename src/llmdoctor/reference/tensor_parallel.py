"""A reference tensor-parallel forward pass: each rank holds only its shards, collectives join them.

The sharding rules are an engine's (vLLM's linear layers, which follow Megatron-LM's tensor
parallelism, Shoeybi et al. 2019, "Megatron-LM", §3): a *column-parallel* weight [out, in] is split
along `out` (each rank computes some output features, no communication); a *row-parallel* weight
[out, in] along `in` (each rank computes a partial sum over its inputs; the partial outputs are
all-reduced); a *vocab-parallel* embedding / lm_head [V, D] along the vocabulary (a rank looks up only
its ids and the lookups are all-reduced; its logits are all-gathered). Every rule in `_RULES` names
its source. Shapes are torch order (slowest first), the GGUF tensors as `forward.Weights` hands them.

A rank runs the reference's own block functions (forward.py, arch_deepseek.py) with a local config
(n_head / T heads) and a `RankWeights` that hands out its shards; the all-reduce after a row-parallel
product is forward.linear's product hook (`forward.product_hook`). An *engine plan* (`Plan`) decides
what each rank holds and which products are reduced: `RulesPlan` follows the rules; a plan from an
engine's saved shards or a planted fault (faults/sharding.py) wraps it. `launch` starts T processes
with torch.distributed (gloo on CPU, NCCL on GPUs with NVLink multicast off: NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from gguf import MODEL_TENSOR, TENSOR_NAMES

from ..errors import InputError, LLMDoctorError
from . import forward as fw
from .config import ModelConfig

# ---- rules ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rules:
    """An engine's sharding conventions beyond the per-tensor table."""

    name: str
    moe: str  # "intermediate": every rank holds every expert's slice of F; "expert": whole experts
    vocab_pad: int  # the vocabulary is padded to a multiple of this before it is split


# vLLM: VocabParallelEmbedding pads the vocabulary to DEFAULT_VOCAB_PADDING_SIZE = 64
# (vocab_parallel_embedding.py pad_vocab_size); FusedMoE splits each expert's intermediate size
# across TP ranks, or with --enable-expert-parallel places whole experts, rank r holding the
# contiguous block r*E/T .. (r+1)*E/T (fused_moe/layer.py determine_expert_map, "linear" placement).
RULES = {
    "vllm": Rules("vllm", moe="intermediate", vocab_pad=64),
    "vllm-ep": Rules("vllm-ep", moe="expert", vocab_pad=64),
}


@dataclass(frozen=True)
class Split:
    """How one tensor is shared out. `dim`: the split dimension (None: replicated); `unit`: rows per
    head along `dim` when the split is by (KV) heads; `reduced`: the products with it are partial sums
    that must be all-reduced."""

    kind: str  # replicate | column | kv_heads | row | vocab | heads | experts | expert_column | expert_row
    dim: int | None = None
    reduced: bool = False


_REPLICATE = Split("replicate")
T_ = MODEL_TENSOR
# Per GGUF tensor kind -> (split, source). Weight shapes: Q [H*Dh, D], K/V [Hk*Dh, D], O [D, H*Dv],
# gate/up [F, D], down [D, F], experts [E, F, D] / [E, D, F], k_b [H, R, Dn], v_b [H, Dv, R].
_RULES: dict[MODEL_TENSOR, tuple[Split, str]] = {
    T_.TOKEN_EMBD: (Split("vocab", 0), "vLLM VocabParallelEmbedding (Megatron VocabParallelEmbedding)"),
    T_.OUTPUT: (Split("vocab", 0), "vLLM ParallelLMHead: logits all-gathered"),
    T_.ATTN_Q: (Split("column", 0), "vLLM QKVParallelLinear: query heads split"),
    T_.ATTN_K: (Split("kv_heads", 0), "vLLM QKVParallelLinear: KV heads split, replicated when T > Hk"),
    T_.ATTN_V: (Split("kv_heads", 0), "vLLM QKVParallelLinear: KV heads split, replicated when T > Hk"),
    T_.ATTN_OUT: (Split("row", 1, True), "vLLM RowParallelLinear o_proj (Megatron: all-reduce after)"),
    T_.FFN_GATE: (Split("column", 0), "vLLM MergedColumnParallelLinear gate_up_proj"),
    T_.FFN_UP: (Split("column", 0), "vLLM MergedColumnParallelLinear gate_up_proj"),
    T_.FFN_DOWN: (Split("row", 1, True), "vLLM RowParallelLinear down_proj"),
    T_.FFN_GATE_SHEXP: (Split("column", 0), "vLLM DeepseekV2MLP shared_experts: gate_up column-parallel"),
    T_.FFN_UP_SHEXP: (Split("column", 0), "vLLM DeepseekV2MLP shared_experts: gate_up column-parallel"),
    T_.FFN_DOWN_SHEXP: (Split("row", 1, True), "vLLM DeepseekV2MLP shared_experts: down row-parallel"),
    T_.ATTN_Q_B: (Split("column", 0), "vLLM DeepseekV2MLAAttention q_b_proj ColumnParallelLinear (heads)"),
    T_.ATTN_KV_B: (Split("column", 0), "vLLM DeepseekV2MLAAttention kv_b_proj ColumnParallelLinear (heads)"),
    T_.ATTN_K_B: (Split("heads", 0), "vLLM MLA: W_UK taken from the rank's kv_b_proj shard, so split by heads"),
    T_.ATTN_V_B: (Split("heads", 0), "vLLM MLA: W_UV taken from the rank's kv_b_proj shard, so split by heads"),
}
# Replicated (vLLM ReplicatedLinear or norms): MLA q_a_proj / kv_a_proj_with_mqa, the router (gate),
# the DSA indexer's wq_b / wk / weights_proj, every norm. A kind not listed is replicated.

_KINDS = {TENSOR_NAMES[k].replace("blk.{bid}.", ""): k for k in TENSOR_NAMES}


def tensor_kind(name: str) -> MODEL_TENSOR | None:
    """GGUF tensor name -> gguf-py's MODEL_TENSOR ("blk.3.attn_q.weight" -> ATTN_Q)."""
    base = name.rsplit(".", 1)[0]
    if base.startswith("blk."):
        base = base.split(".", 2)[2]
    return _KINDS.get(base)


def split_of(name: str, rules: Rules) -> tuple[Split, str]:
    """(split, source) of a GGUF tensor under `rules`. Biases split like their weights' output dim."""
    kind = tensor_kind(name)
    if kind in (T_.FFN_GATE_EXP, T_.FFN_UP_EXP, T_.FFN_DOWN_EXP):
        down = kind == T_.FFN_DOWN_EXP
        if rules.moe == "expert":
            return Split("experts", 0, down), "vLLM FusedMoE with expert parallelism: whole experts per rank"
        return (Split("expert_row", 2, True) if down else Split("expert_column", 1),
                "vLLM FusedMoE: w13 split along the intermediate size, w2 along its input")
    split, source = _RULES.get(kind, (_REPLICATE, "replicated (vLLM ReplicatedLinear / norms)"))
    if name.endswith(".bias") and split.kind == "row":
        return _REPLICATE, "row-parallel bias: added once, after the all-reduce"
    return split, source


def _even(size: int, t: int, what: str) -> int:
    if size % t:
        raise InputError(f"{what} ({size}) does not split into {t} tensor-parallel ranks")
    return size // t


def vocab_per_rank(n_vocab: int, t: int, rules: Rules) -> int:
    """Rows of each rank's vocab shard: the vocabulary padded to a multiple of `vocab_pad`, split evenly."""
    return _even(-(-n_vocab // rules.vocab_pad) * rules.vocab_pad, t, "the padded vocabulary")


def vocab_range(n_vocab: int, rank: int, t: int, rules: Rules) -> tuple[int, int]:
    """Rows [lo, hi) of the vocabulary rank `rank` owns; its padding rows (past n_vocab) are owned but
    empty (vLLM vocab_range_from_global_vocab_size)."""
    per = vocab_per_rank(n_vocab, t, rules)
    return min(rank * per, n_vocab), min((rank + 1) * per, n_vocab)


def shard_slice(split: Split, shape: tuple[int, ...], rank: int, t: int, cfg: ModelConfig) -> slice:
    """The rule's slice along `split.dim` for rank `rank` (not for vocab splits: `vocab_range`)."""
    size = shape[split.dim]
    if split.kind == "kv_heads" and t > cfg.n_head_kv:  # replicas: T / Hk ranks share each KV head
        unit = size // cfg.n_head_kv
        h = rank // _even(t, cfg.n_head_kv, "the KV head replicas")
        return slice(h * unit, (h + 1) * unit)
    per = _even(size, t, f"dim {split.dim} of a {split.kind} tensor")
    return slice(rank * per, (rank + 1) * per)


def local_config(cfg: ModelConfig, t: int) -> ModelConfig:
    """The config one rank runs: H / T query heads, max(Hk / T, 1) KV heads."""
    return dataclasses.replace(cfg, n_head=_even(cfg.n_head, t, "the attention heads"),
                               n_head_kv=max(cfg.n_head_kv // t, 1))


# ---- plans: what each rank holds ------------------------------------------------------------------

class Plan:
    """What an engine's ranks hold and which products it all-reduces. The base is the rules' plan:
    shards cut from the reference weights as `_RULES` says."""

    def __init__(self, weights: fw.Weights, cfg: ModelConfig, rules: Rules, t: int):
        self.weights, self.cfg, self.rules, self.t = weights, cfg, rules, t

    def split(self, name: str) -> Split:
        return split_of(name, self.rules)[0]

    def has(self, name: str) -> bool:
        return self.weights.has(name)

    def shard(self, name: str, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of a non-vocab tensor."""
        w, split = self.weights.get(name), self.split(name)
        if split.dim is None:
            return w
        idx = [slice(None)] * w.ndim
        idx[split.dim] = shard_slice(split, tuple(w.shape), rank, self.t, self.cfg)
        return w[tuple(idx)].clone()  # not a view: the whole tensor is freed

    def vocab_start(self, name: str, rank: int) -> int:
        """First vocabulary row of the rank's shard of a vocab-parallel tensor."""
        return vocab_range(self.cfg.n_vocab, rank, self.t, self.rules)[0]

    def vocab_rows(self, name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
        """Rows `local` (indices into the rank's shard) of a vocab-parallel tensor [n, D]; rows past
        the vocabulary (padding) are zeros."""
        rows = self.vocab_start(name, rank) + local.cpu()
        valid = rows < self.cfg.n_vocab
        out = torch.zeros(len(rows), self.cfg.n_embd, dtype=self.weights.dtype, device=self.weights.device)
        if valid.any():
            out[valid.to(out.device)] = self.weights.rows(name, rows[valid])
        return out

    def reduces(self, name: str) -> bool:
        """Whether the engine all-reduces the products with this (row-parallel) tensor."""
        return self.split(name).reduced

    def stored_dtype(self, name: str, rank: int) -> torch.dtype:
        """The dtype the rank's shard was held in before it became the run's (an engine's may be narrower)."""
        return self.weights.dtype


class PlanWrapper(Plan):
    """A plan that changes another one (engine shards, planted faults, substitutions); delegates all."""

    def __init__(self, inner: Plan):
        self.inner = inner
        self.weights, self.cfg, self.rules, self.t = inner.weights, inner.cfg, inner.rules, inner.t

    def has(self, name: str) -> bool:
        return self.inner.has(name)

    def shard(self, name: str, rank: int) -> torch.Tensor:
        return self.inner.shard(name, rank)

    def vocab_start(self, name: str, rank: int) -> int:
        return self.inner.vocab_start(name, rank)

    def vocab_rows(self, name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
        return self.inner.vocab_rows(name, rank, local)

    def reduces(self, name: str) -> bool:
        return self.inner.reduces(name)

    def stored_dtype(self, name: str, rank: int) -> torch.dtype:
        return self.inner.stored_dtype(name, rank)


class Substituted(PlanWrapper):
    """`inner` with the reference's shards of `shards` and the reference's collectives after
    `collectives`: a rerun with one suspect replaced shows whether it explains a divergence."""

    def __init__(self, inner: Plan, reference: Plan, shards: Iterable[str] = (), collectives: Iterable[str] = ()):
        super().__init__(inner)
        self.reference, self.shards, self.collectives = reference, set(shards), set(collectives)

    def shard(self, name: str, rank: int) -> torch.Tensor:
        return (self.reference if name in self.shards else self.inner).shard(name, rank)

    def vocab_start(self, name: str, rank: int) -> int:
        return (self.reference if name in self.shards else self.inner).vocab_start(name, rank)

    def vocab_rows(self, name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
        return (self.reference if name in self.shards else self.inner).vocab_rows(name, rank, local)

    def reduces(self, name: str) -> bool:
        return (self.reference if name in self.collectives else self.inner).reduces(name)


class StoredAs:
    """Weights (forward.Weights) as an engine stores them: each tensor named in `dtypes` rounded through
    that dtype (e.g. bfloat16) and back, so that a reference run computes with the engine's values."""

    def __init__(self, inner: Any, dtypes: dict[str, torch.dtype]):
        self.inner, self.dtypes = inner, dtypes

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _round(self, name: str, w: torch.Tensor) -> torch.Tensor:
        d = self.dtypes.get(name)
        return w if d is None or d == w.dtype else w.to(d).to(w.dtype)

    def get(self, name: str) -> torch.Tensor:
        return self._round(name, self.inner.get(name))

    def rows(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        return self._round(name, self.inner.rows(name, ids))

    def slab(self, name: str, i: int) -> torch.Tensor:
        return self._round(name, self.inner.slab(name, i))

    def row_slices(self, name: str, chunk: int) -> Iterable[torch.Tensor]:
        return (self._round(name, w) for w in self.inner.row_slices(name, chunk))


# ---- one rank -------------------------------------------------------------------------------------

class RankWeights:
    """One rank's weights for a `forward.Step`: `get`/`slab` hand out its shards (kept while the point
    runs, so that their storage addresses identify them to the product hook) and record which tensors
    were used."""

    def __init__(self, plan: Plan, rank: int):
        self.plan, self.rank = plan, rank
        self.dtype, self.device = plan.weights.dtype, plan.weights.device
        self.qtypes: dict[int, int] = {}  # forward.engine_input reads it when emulating an engine: never here
        self._shards: dict[str, torch.Tensor] = {}
        self._zeros: dict[str, torch.Tensor] = {}
        self._reduced: dict[int, str] = {}  # data_ptr -> name: products with it are partial sums
        self.used: list[str] = []

    def _use(self, name: str) -> None:
        if name not in self.used:
            self.used.append(name)

    def has(self, name: str) -> bool:
        return self.plan.has(name)

    def get(self, name: str) -> torch.Tensor:
        w = self._shards.get(name)
        if w is None:
            w = self._shards[name] = self.plan.shard(name, self.rank).contiguous()
            if self.plan.split(name).reduced:
                self._reduced[w.data_ptr()] = name
        self._use(name)
        return w

    def slab(self, name: str, e: int) -> torch.Tensor:
        """Expert e's matrix as this rank holds it: its slice of F, or (expert parallelism) the whole
        matrix when the rank owns e and zeros when it does not (a zero contribution to the all-reduce,
        standing for the expert computed elsewhere)."""
        w = self.get(name)
        split = self.plan.split(name)
        if split.kind == "experts":
            per = w.shape[0]
            lo = self.rank * per
            if lo <= e < lo + per:
                w = w[e - lo]
            else:
                w = self._zeros.setdefault(name, torch.zeros(w.shape[1:], dtype=w.dtype, device=w.device))
        else:
            w = w[e]
        if split.reduced:
            self._reduced[w.data_ptr()] = name
        return w

    def reduced_name(self, w: torch.Tensor) -> str | None:
        return self._reduced.get(w.data_ptr())


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the ranks (the engine's all-reduce), in place on a contiguous copy."""
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def rank_hook(rw: RankWeights) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The product hook of a rank: all-reduce y = x w^T when w is row-parallel and the plan reduces it."""

    def hook(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        name = rw.reduced_name(w)
        return all_reduce(y) if name is not None and rw.plan.reduces(name) else y

    return hook


def halves(cfg: ModelConfig, il: int) -> tuple[Callable, Callable]:
    """(attention, FFN) functions of layer il, the reference block's own (forward.py, arch_deepseek.py)."""
    if cfg.mla is None:
        return fw.dense_attention, fw.dense_ffn
    from .arch_deepseek import mla_attention, moe_ffn

    dense = cfg.moe is None or il < cfg.moe.n_dense_lead
    return mla_attention, fw.dense_ffn if dense else moe_ffn


EMBED, LOGITS = "embedding", "logits"


def point_names(cfg: ModelConfig, n_layer: int) -> list[str]:
    """The all-reduced / all-gathered points compared, in graph order."""
    return [EMBED, *(f"{p}-{il}" for il in range(n_layer) for p in ("attn_out", "ffn_out")), LOGITS]


class Rank:
    """One rank of the TP forward: runs a point (teacher-forced from the reference's input of that
    point) with its shards and the engine plan's collectives; every rank gets the joined result."""

    def __init__(self, plan: Plan, rank: int, positions: torch.Tensor, vocab_chunk: int = 2048,
                 kv_chunk: int | None = 4096):
        # vocab_chunk, kv_chunk: as ReferenceModel's defaults, so attention is chunked the same way
        self.plan, self.rank, self.positions = plan, rank, positions
        self.vocab_chunk, self.kv_chunk = vocab_chunk, kv_chunk
        self.cfg = plan.cfg
        self.local = local_config(plan.cfg, plan.t)
        self.extra: dict = {}  # per-run state the blocks share (the DSA indexer's last selection)

    def run(self, point: str, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """The joined output of `point`; `inputs`: token ids ("ids") and the reference's activations.
        The rank holds the shards of one point at a time (`self.weights`, with the names it used)."""
        self.weights = RankWeights(self.plan, self.rank)
        if point == EMBED:
            return self._embed(inputs["ids"])
        if point == LOGITS:
            return self._logits(inputs["result_norm"])
        kind, il = point.rsplit("-", 1)
        il = int(il)
        attention, ffn = halves(self.cfg, il)
        fn, src = (attention, "attn_norm") if kind == "attn_out" else (ffn, "ffn_norm")
        st = fw.Step(self.local, il, self.positions, self.weights, fw.Recorder(None), self.kv_chunk, self.extra)
        with fw.product_hook(rank_hook(self.weights)):
            return fn(st, inputs[f"{src}-{il}"])

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: the rank's ids from its shard, zeros elsewhere, all-reduced."""
        name = fw.tensor_name(MODEL_TENSOR.TOKEN_EMBD)
        self.weights._use(name)
        lo, hi = vocab_range(self.cfg.n_vocab, self.rank, self.plan.t, self.plan.rules)
        mine = (ids >= lo) & (ids < hi)
        x = torch.zeros(len(ids), self.cfg.n_embd, dtype=self.weights.dtype, device=self.weights.device)
        if mine.any():
            x[mine.to(x.device)] = self.plan.vocab_rows(name, self.rank, (ids[mine] - lo).cpu())
        x = all_reduce(x)
        return x * self.cfg.embed_scale if self.cfg.embed_scale != 1.0 else x

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lm_head: the rank's logits, padded to the shard size, all-gathered in rank order."""
        out = fw.tensor_name(MODEL_TENSOR.OUTPUT)
        name = out if self.plan.has(out) else fw.tensor_name(MODEL_TENSOR.TOKEN_EMBD)
        self.weights._use(name)
        t, rules = self.plan.t, self.plan.rules
        per = vocab_per_rank(self.cfg.n_vocab, t, rules)
        local = torch.zeros(h.shape[0], per, dtype=h.dtype, device=h.device)  # [T, V/T] padded
        col = 0
        lo, hi = vocab_range(self.cfg.n_vocab, self.rank, t, rules)
        for r in range(0, hi - lo, self.vocab_chunk):
            w = self.plan.vocab_rows(name, self.rank, torch.arange(r, min(r + self.vocab_chunk, hi - lo)))
            local[:, col:col + w.shape[0]] = fw.linear(h, w)
            col += w.shape[0]
        parts = [torch.empty_like(local) for _ in range(t)]
        dist.all_gather(parts, local)
        logits = torch.cat(parts, dim=-1)[:, :self.cfg.n_vocab]
        sc = self.cfg.final_softcap
        return sc * torch.tanh(logits / sc) if sc else logits


# ---- launching ------------------------------------------------------------------------------------

class RankFailed(LLMDoctorError):
    """A rank of a launch raised or died (its error, in one line)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _entry(rank: int, t: int, port: int, device: str, fn: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # T processes share the machine's cores
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
    dist.init_process_group(backend_for(device), rank=rank, world_size=t)
    try:
        result = fn(rank, t, dev, *args)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def check_devices(t: int, device: str) -> None:
    """T ranks on `device`: cpu (gloo processes) or cuda (one GPU per rank), else one line why not."""
    if device == "cpu":
        return
    if not device.startswith("cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < t:
        raise InputError(f"--device {device}: {t} CUDA devices needed (one per rank), {n} available")


def launch(t: int, fn: Callable[..., Any], args: tuple, *, device: str = "cpu") -> Any:
    """Run fn(rank, t, device, *args) on T spawned processes (torch.multiprocessing); rank 0's return
    value comes back. `fn` must be a module-level function. NCCL runs with NVLink multicast off."""
    check_devices(t, device)
    if device.startswith("cuda"):
        os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="llmdoctor-tp-") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        try:  # a rank that fails ends the others (spawn terminates them): one line says which and why
            mp.spawn(_entry, args=(t, _free_port(), device, fn, args, out), nprocs=t, join=True)
        except mp.ProcessRaisedException as e:
            last = [line for line in str(e).splitlines() if line.strip()][-1]
            raise RankFailed(f"rank {e.error_index} of {t} failed: {last.strip()}") from None
        except mp.ProcessExitedException as e:
            raise RankFailed(f"rank {e.error_index} of {t} exited with code {e.exit_code}") from None
        return torch.load(out, weights_only=False)
