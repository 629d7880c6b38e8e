"""Planted tensor-parallel sharding faults: an engine plan (reference/tensor_parallel.py `Plan`) that
holds or joins its shards wrongly. `build(plan)` wraps the rules' plan and returns the faulty one;
`check sharding` (checks/file/sharding.py) must find the first divergent layer and name `expect`. Its
caller hands it `plant`, which its ranks call to build a fault's plan by name.
"""

from __future__ import annotations

import torch
from gguf import MODEL_TENSOR

from ..errors import InputError
from ..reference import tensor_parallel as tp
from . import get, register

KIND = "sharding"


def plant(name: str, plan: tp.Plan) -> tp.Plan:
    """The rules' `plan` with the planted fault `name` (checks/file/sharding.py `Plant`)."""
    return get(name).build(plan)


class _HeadsPermuted(tp.PlanWrapper):
    """Every layer's query projection with its heads in the wrong rank order: rank r holds the query
    heads of rank T-1-r, its K/V/O shards are right (a loader that reversed the rank order of one tensor)."""

    def shard(self, name: str, rank: int) -> torch.Tensor:
        if tp.tensor_kind(name) in (MODEL_TENSOR.ATTN_Q, MODEL_TENSOR.ATTN_Q_B):
            return self.inner.shard(name, self.t - 1 - rank)
        return self.inner.shard(name, rank)


@register("sharding-heads-permuted", KIND, "query heads in the wrong order across ranks (rank r holds rank "
          "T-1-r's query heads; K, V and O are right)", expect="attn_q")
def heads_permuted(plan: tp.Plan) -> tp.Plan:
    return _HeadsPermuted(plan)


class _KvBLatentAxis(tp.PlanWrapper):
    """MLA's kv_b split along the latent axis R instead of by heads, each piece then viewed in the
    shape the rank expects ([H/T, R, Dn] for k_b, [H/T, Dv, R] for v_b, [H*(Dn+Dv)/T, R] for kv_b)."""

    _AXIS = {MODEL_TENSOR.ATTN_K_B: 1, MODEL_TENSOR.ATTN_V_B: 2, MODEL_TENSOR.ATTN_KV_B: 1}  # R's dim

    def shard(self, name: str, rank: int) -> torch.Tensor:
        axis = self._AXIS.get(tp.tensor_kind(name))
        if axis is None:
            return self.inner.shard(name, rank)
        right = self.inner.shard(name, rank)
        full = self.weights.get(name)
        wrong = full.narrow(axis, rank * (full.shape[axis] // self.t), full.shape[axis] // self.t)
        return wrong.reshape(right.shape)


@register("sharding-kv-b-latent-axis", KIND, "MLA kv_b (k_b, v_b) split along the latent axis instead of by "
          "heads, reshaped into each rank's head shape", expect="attn_k_b")
def kv_b_latent_axis(plan: tp.Plan) -> tp.Plan:
    if plan.cfg.mla is None:
        raise InputError("sharding-kv-b-latent-axis needs an MLA model (deepseek2, glm-dsa)")
    return _KvBLatentAxis(plan)


class _VocabOffset(tp.PlanWrapper):
    """The embedding's vocab shards offset by one rank: rank r holds the rows of rank r+1 (the last
    rank rows past the vocabulary, i.e. zeros) while it still looks up the ids of its own range."""

    def vocab_start(self, name: str, rank: int) -> int:
        start = self.inner.vocab_start(name, rank)
        if tp.tensor_kind(name) != MODEL_TENSOR.TOKEN_EMBD:
            return start
        return start + (tp.vocab_range(self.cfg.n_vocab, 1, self.t, self.rules)[0]
                        - tp.vocab_range(self.cfg.n_vocab, 0, self.t, self.rules)[0])

    def vocab_rows(self, name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
        return tp.Plan.vocab_rows(self, name, rank, local)  # the rules' lookup from the shifted start


@register("sharding-vocab-offset", KIND, "vocab-parallel embedding shards offset by one rank", expect="token_embd")
def vocab_offset(plan: tp.Plan) -> tp.Plan:
    return _VocabOffset(plan)


class _NoAllReduce(tp.PlanWrapper):
    """The attention output projection (row-parallel) without its all-reduce: each rank keeps its
    partial sum."""

    def reduces(self, name: str) -> bool:
        return tp.tensor_kind(name) != MODEL_TENSOR.ATTN_OUT and self.inner.reduces(name)


@register("sharding-missing-all-reduce", KIND, "no all-reduce after the row-parallel attention output "
          "projection", expect="all-reduce after blk.0.attn_output")
def missing_all_reduce(plan: tp.Plan) -> tp.Plan:
    return _NoAllReduce(plan)


class _ExpertsWrongRank(tp.PlanWrapper):
    """Expert parallelism with the experts on the wrong rank: rank r holds rank r+1's experts (mod T)
    in the slots of its own."""

    def shard(self, name: str, rank: int) -> torch.Tensor:
        if tp.tensor_kind(name) in (MODEL_TENSOR.FFN_GATE_EXP, MODEL_TENSOR.FFN_UP_EXP, MODEL_TENSOR.FFN_DOWN_EXP):
            return self.inner.shard(name, (rank + 1) % self.t)
        return self.inner.shard(name, rank)


@register("sharding-experts-wrong-rank", KIND, "expert-parallel experts assigned to the wrong rank (rank r "
          "holds rank r+1's experts)", expect="_exps")
def experts_wrong_rank(plan: tp.Plan) -> tp.Plan:
    if plan.cfg.moe is None or plan.rules.moe != "expert":
        raise InputError("sharding-experts-wrong-rank needs an MoE model and expert-parallel rules (--rules vllm-ep)")
    return _ExpertsWrongRank(plan)
