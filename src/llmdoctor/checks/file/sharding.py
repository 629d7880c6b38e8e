"""`check sharding`: is a model split across T tensor-parallel ranks the way the engine's rules say?

Two checks, both against shards cut from the reference weights by reference/tensor_parallel.py's rules:

1. **Saved shards** (`--engine-shards DIR`): the tensors an engine's ranks hold, saved by the user's
   script as DIR/rank{r}.safetensors (format: README "check sharding"), are compared with the rules'
   shards, tensor by tensor; a shard that is another rank's is named as such.
2. **Tensor-parallel forward**: T processes (torch.distributed: gloo on CPU, NCCL on GPUs) each hold
   only their shards (the engine's when saved, else the rules') and run the reference's own layer code
   with the collectives: the vocab-parallel embedding all-reduced, every row-parallel product
   all-reduced, the vocab-parallel logits all-gathered. Each joined point (the embedding, every
   layer's attn_out and ffn_out, the logits) is computed from the single-device reference's input of
   that point (teacher forcing), so one layer's fault does not smear into the next, and compared with
   the single-device reference's value within a derived budget. The first point over budget is the
   first divergent layer; the tensor whose sharding explains it is found by substitution: the point is
   rerun with the rules' shards of the suspects (the tensors the point used whose shards differ from the
   rules' on some rank), one at a time, then together, then with each missing all-reduce restored;
   the first rerun within budget names the culprit.

Budget (metrics.reordered_sum_bound): a joined point differs from the single-device value only in the
order of its sums: the all-reduce sums T partial sums of K/T terms where one device sums K terms, and
a BLAS may block a narrower column-parallel product differently. Each order is within γ_n(u)·M of the
exact value, M the point's magnitude Σ|x_k||w_k| of its row-parallel products (the single-device
reference's own |x| @ |W|^T, captured through the product hook), n the roundings of the longest chain
that leads to it: the row-parallel sum (K), the column-parallel products before it (n_embd, and MLA's
q_lora / nope / latent lengths), and for attention the score dot product and the two sums over the T
keys. Only the row-parallel sums are bounded rigorously this way; the column side (each rank's
heads, computed on narrower matrices) enters through the chain's n to first order: on this CPU its
float32 products are bit-identical to the single device's columns (measured), its float64 ones are
not, and the correct sharding then still uses at most 3% of the budget (bench/RESULTS.md).
MoE outputs use a per-column bound of the routed experts (max over experts of the row maxima,
times n_used and the routing scale: the routing weights are at most the scale) plus the shared
expert's. The embedding lookup is exact (one rank contributes each row, the others zeros), so its
budget is 0; the logits are a column-parallel product (n = n_embd).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from ...errors import InputError
from ...reference import forward as fw
from ...reference import tensor_parallel as tp
from .. import metrics
from ..base import Finding

CHECK = "sharding"
DTYPES = {"float32": torch.float32, "float64": torch.float64}
# (fault name, the rules' plan) -> the engine plan with that fault planted: faults/sharding.py `plant`,
# handed in by the caller (checks never import faults) and pickled to the ranks as a module-level function
Plant = Callable[[str, tp.Plan], tp.Plan]


# ---- the engine's saved shards ---------------------------------------------------------------------

class EngineShards(tp.PlanWrapper):
    """The shards an engine's ranks hold, from DIR/rank{r}.safetensors (GGUF tensor names, each rank's
    piece in the GGUF tensor's torch layout); tensors not saved come from the rules."""

    def __init__(self, inner: tp.Plan, directory: Path):
        from safetensors import safe_open

        super().__init__(inner)
        self.files = [directory / f"rank{r}.safetensors" for r in range(inner.t)]
        missing = [str(f) for f in self.files if not f.is_file()]
        if missing:
            raise InputError(f"{directory}: no {', '.join(Path(m).name for m in missing)} "
                             f"(one rank{{r}}.safetensors per rank for --tp {inner.t})")
        try:  # opened lazily: a tensor is read when a rank needs it
            self.handles = [safe_open(str(f), framework="pt") for f in self.files]
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise InputError(f"{directory}: not a safetensors file ({e})") from None
        self.names = [set(h.keys()) for h in self.handles]

    def saved(self, name: str, rank: int) -> torch.Tensor | None:
        return self.handles[rank].get_tensor(name) if name in self.names[rank] else None

    def stored_dtype(self, name: str, rank: int) -> torch.dtype:
        if name not in self.names[rank]:
            return self.inner.stored_dtype(name, rank)
        return self.saved(name, rank).dtype

    def shard(self, name: str, rank: int) -> torch.Tensor:
        w = self.saved(name, rank)
        return self.inner.shard(name, rank) if w is None else w.to(self.weights.dtype).to(self.weights.device)

    def vocab_rows(self, name: str, rank: int, local: torch.Tensor) -> torch.Tensor:
        w = self.saved(name, rank)
        if w is None:
            return self.inner.vocab_rows(name, rank, local)
        out = torch.zeros(len(local), w.shape[1], dtype=self.weights.dtype, device=self.weights.device)
        ok = local < w.shape[0]  # rows past the saved ones are the zero padding
        out[ok] = w[local[ok]].to(self.weights.dtype).to(self.weights.device)
        return out


def narrower_dtypes(engine: EngineShards, dtype: torch.dtype) -> dict[str, torch.dtype]:
    """{name: dtype} of the saved tensors (rank 0's) held in a float dtype narrower than the run's: the
    forward then compares the engine's sharding of those values with one device holding the same values."""
    out = {}
    for name in engine.names[0]:
        d = engine.stored_dtype(name, 0)
        if d.is_floating_point and torch.finfo(d).bits < torch.finfo(dtype).bits:
            out[name] = d
    return out


def _full_shard(plan: tp.Plan, name: str, rank: int) -> torch.Tensor:
    """A rank's whole shard; a vocab shard as the engine holds it: padded V / T rows, the rows past
    the vocabulary zero."""
    if plan.split(name).kind == "vocab":
        return plan.vocab_rows(name, rank, torch.arange(tp.vocab_per_rank(plan.cfg.n_vocab, plan.t, plan.rules)))
    return plan.shard(name, rank)


def _as_held(got: torch.Tensor, plan: tp.Plan, name: str) -> torch.Tensor:
    """A saved vocab shard without its padding rows, padded with the zero rows the engine holds."""
    per = tp.vocab_per_rank(plan.cfg.n_vocab, plan.t, plan.rules)
    if plan.split(name).kind != "vocab" or got.ndim != 2 or got.shape[0] >= per:
        return got
    return torch.cat([got, got.new_zeros(per - got.shape[0], got.shape[1])])


def _stored_bound(want: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|engine - reference| allowed for a stored weight: the float32 dequantization's own roundings
    (checks/kernels/dequant.py REFERENCE_ROUNDINGS: an engine may evaluate a GGUF block's d*q - m in another
    order), plus one rounding into a narrower dtype the engine stores (e.g. bfloat16)."""
    from ..kernels.dequant import REFERENCE_ROUNDINGS

    b = metrics.rounding_bound(want, torch.float32, REFERENCE_ROUNDINGS)
    return b + metrics.rounding_bound(want, dtype, 1) if dtype != torch.float32 else b


def compare_saved(engine: EngineShards, reference: tp.Plan) -> list[Finding]:
    """One finding per saved tensor name (all ranks), one for names not in the model, one skip
    listing the model's sharded tensors the engine did not save."""
    names = set().union(*engine.names)
    unknown = sorted(n for n in names if not reference.has(n))
    findings = []
    if unknown:
        findings.append(Finding(CHECK, "engine-shards", "names", "fail",
                                reason=f"{len(unknown)} saved tensors are not tensors of the model",
                                evidence=unknown[:20]))
    for name in sorted(names - set(unknown)):
        findings.append(_compare_tensor(engine, reference, name))
    model = [t.name for t in engine.weights.g.tensors if reference.split(t.name).kind != "replicate"]
    not_saved = [n for n in model if n not in names]
    if not_saved:
        findings.append(Finding(CHECK, "engine-shards", "not-saved", "skip",
                                reason=f"{len(not_saved)} sharded tensors of the model were not saved "
                                       f"(the forward uses the rules' shards for them)", evidence=not_saved[:20]))
    return findings


def _compare_tensor(engine: EngineShards, reference: tp.Plan, name: str) -> Finding:
    split, source = tp.split_of(name, reference.rules)
    bad: list[dict[str, Any]] = []
    worst = 0.0
    for r in range(reference.t):
        got = engine.saved(name, r)
        if got is None:
            bad.append({"rank": r, "problem": "not saved on this rank"})
            continue
        got, want = _as_held(got, reference, name), _full_shard(reference, name, r)
        if tuple(got.shape) != tuple(want.shape):
            bad.append({"rank": r, "problem": f"shape {list(got.shape)}, the rule gives {list(want.shape)}"})
            continue
        d = metrics.max_abs_diff(got, want)
        worst = max(worst, d)
        if metrics.over_budget(got, want, _stored_bound(want, got.dtype)).any():
            other = next((o for o in range(reference.t) if o != r and _matches(got, reference, name, o)), None)
            bad.append({"rank": r, "max_abs_diff": d,
                        "problem": f"holds rank {other}'s shard" if other is not None else "differs from the rule's shard"})
    mets = {"max_abs_diff": worst, "ranks": reference.t}
    rule = {"split": split.kind, "dim": split.dim, "source": source}
    if not bad:
        return Finding(CHECK, "engine-shards", name, "pass", reason="every rank's shard is the rule's",
                       metrics=mets, budget=rule)
    expl = "; ".join(f"rank {b['rank']}: {b['problem']}" for b in bad)
    return Finding(CHECK, "engine-shards", name, "fail", reason=f"{name}: {expl}", metrics=mets, budget=rule,
                   explanation=f"{name} is not sharded as {source} ({split.kind}) says: {expl}", evidence=bad)


def _matches(got: torch.Tensor, reference: tp.Plan, name: str, rank: int) -> bool:
    want = _full_shard(reference, name, rank)
    return tuple(got.shape) == tuple(want.shape) and not metrics.over_budget(
        got, want, _stored_bound(want, got.dtype)).any()


# ---- the single-device reference and its budgets -----------------------------------------------------

class _Magnitudes:
    """Product hook of the single-device run: accumulates M = |x| @ |W|^T of every row-parallel product
    per joined point, and of the output projection's slices for the logits (module docstring). M is
    computed in the run dtype (a sum of non-negative terms, so the computed value is at least
    M·(1 - γ_K)) and divided by 1 - γ_K(u): an upper bound of the exact M."""

    def __init__(self, weights: fw.Weights, rules: tp.Rules, moe: Any):
        self.weights, self.rules, self.moe = weights, rules, moe
        self.names: dict[int, tuple[str, weakref.ref]] = {}  # data_ptr -> (name, the tensor)
        self.m: dict[str, torch.Tensor] = {}
        self.logits: list[torch.Tensor] = []
        self._slice: torch.Tensor | None = None  # the output projection's slice being multiplied
        get, slab, row_slices = weights.get, weights.slab, weights.row_slices
        weights.get = lambda name: self._note(name, get(name))  # type: ignore[method-assign]
        weights.slab = lambda name, e: self._note(name, slab(name, e))  # type: ignore[method-assign]
        weights.row_slices = lambda name, chunk: map(self._note_slice, row_slices(name, chunk))  # type: ignore

    def _note(self, name: str, w: torch.Tensor) -> torch.Tensor:
        if tp.split_of(name, self.rules)[0].reduced:
            self.names[w.data_ptr()] = (name, weakref.ref(w))
        return w

    def _note_slice(self, w: torch.Tensor) -> torch.Tensor:
        self._slice = w
        return w

    @staticmethod
    def _abs_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        m = (x.abs() @ w.abs().t()).double()  # [n, out]
        return m / (1 - metrics.gamma(x.shape[-1], metrics.unit_roundoff(x.dtype)))

    def __call__(self, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if w is self._slice:
            self.logits.append(self._abs_product(x, w))
            return y
        hit = self.names.get(w.data_ptr())  # an address is reused once its tensor is freed: check identity
        if hit is None or hit[1]() is not w:
            return y
        name = hit[0]
        kind = tp.tensor_kind(name)
        point = f"{'attn_out' if kind == fw.MODEL_TENSOR.ATTN_OUT else 'ffn_out'}-{name.split('.')[1]}"
        m = self._abs_product(x, w)  # [n, D]
        if kind == fw.MODEL_TENSOR.FFN_DOWN_EXP:  # rows of some tokens: a per-column bound for all
            routed = f"{point}/routed"
            col = m.amax(0) * self.moe.n_used * self.moe.scale  # [D]
            self.m[routed] = torch.maximum(self.m[routed], col) if routed in self.m else col
        else:
            self.m[point] = self.m.get(point, 0) + m
        return y

    def magnitude(self, point: str, shape: tuple[int, int]) -> torch.Tensor:
        if point == tp.LOGITS:
            return torch.cat(self.logits, -1)
        m = self.m.get(point, torch.zeros(shape, dtype=torch.float64))
        routed = self.m.get(f"{point}/routed")
        return m + routed if routed is not None else m


def chain_roundings(cfg: Any, point: str, n_tokens: int) -> int:
    """n of the longest chain of roundings leading to a joined point (module docstring)."""
    if point == tp.LOGITS:
        return cfg.n_embd
    kind, il = point.rsplit("-", 1)
    if kind == "attn_out":
        if cfg.mla is not None:
            m = cfg.mla
            col = cfg.n_embd + m.q_lora_rank + m.qk_nope + m.kv_lora_rank  # q_a, q_b, absorb, v_b
            return cfg.n_head * m.v_dim + col + m.kv_lora_rank + m.qk_rope + 2 * n_tokens
        return cfg.n_head * cfg.head_dim_v + cfg.n_embd + cfg.head_dim + 2 * n_tokens
    moe = cfg.moe
    if moe is not None and int(il) >= moe.n_dense_lead:
        return moe.n_ff_exp * max(moe.n_shared, 1) + cfg.n_embd + moe.n_used + moe.n_shared + 1
    return cfg.n_ff + cfg.n_embd


@dataclass
class Reference:
    """The single-device reference of the first `n_layer` layers: the inputs of every joined point,
    their values and budgets."""

    n_layer: int
    points: list[str]
    inputs: dict[str, torch.Tensor]
    want: dict[str, torch.Tensor]
    bound: dict[str, torch.Tensor]
    roundings: dict[str, int]
    seconds: float = 0.0


def reference(path: Path, ids: torch.Tensor, rules: tp.Rules, *, n_layer: int | None, dtype: torch.dtype,
              device: str = "cpu", stored: dict[str, torch.dtype] | None = None) -> Reference:
    """`stored`: tensors the engine holds in a narrower dtype, rounded to it here too (tp.StoredAs)."""
    import dataclasses

    from ...reference import load

    t0 = time.perf_counter()
    with load(path, dtype=dtype, device=device) as model:
        cfg = model.config
        total = cfg.n_layer - cfg.n_nextn
        n = total if n_layer is None else n_layer
        if not 1 <= n <= total:
            raise InputError(f"--layers {n_layer}: the model has {total} layers")
        model.config = dataclasses.replace(cfg, n_layer=n, n_nextn=0)  # the first n blocks, then the head
        if stored:
            model.weights = tp.StoredAs(model.weights, stored)
        mags = _Magnitudes(model.weights, rules, cfg.moe)
        with fw.product_hook(mags):
            logits, cap = model.forward(ids, capture=["attn_norm-*", "ffn_norm-*", "attn_out-*", "ffn_out-*",
                                                      "result_norm"])
        embd_name = fw.tensor_name(fw.MODEL_TENSOR.TOKEN_EMBD)
        emb = model.weights.rows(embd_name, ids)
        emb = emb * cfg.embed_scale if cfg.embed_scale != 1.0 else emb
        points = tp.point_names(cfg, n)
        want = {tp.EMBED: emb, tp.LOGITS: logits, **{p: cap[p] for p in points[1:-1]}}
        inputs = {"ids": ids, "result_norm": cap["result_norm"],
                  **{k: v for k, v in cap.items() if k.startswith(("attn_norm-", "ffn_norm-"))}}
        bound, roundings = {tp.EMBED: torch.zeros(emb.numel(), dtype=torch.float64)}, {tp.EMBED: 0}
        for p in points[1:]:
            roundings[p] = chain_roundings(cfg, p, len(ids))
            bound[p] = metrics.reordered_sum_bound(mags.magnitude(p, tuple(want[p].shape)), dtype, roundings[p])
    cpu = lambda d: {k: v.cpu() for k, v in d.items()}  # noqa: E731  (the ranks get them pickled)
    return Reference(n, points, cpu(inputs), cpu(want), cpu(bound), roundings, time.perf_counter() - t0)


def judge(point: str, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, subject: str) -> Finding:
    """One joined point against the single-device reference within its budget."""
    over = metrics.over_budget(got, want, bound)
    d = metrics.abs_diff(got, want)
    ratio = torch.where(bound > 0, d / bound.clamp_min(1e-300), torch.where(d > 0, torch.inf, 0.0))
    mets = {"max_abs_diff": float(d.max()), "rel_l2": metrics.rel_l2(got, want),
            "max_over_budget": float(ratio.max()), "n_over": int(over.sum()), "n": int(over.numel())}
    budget = {"rule": "2·γ_n(u)·Σ|x||w| of the reordered sums (metrics.reordered_sum_bound)",
              "max_bound": float(bound.max())}
    if not over.any():
        return Finding(CHECK, subject, point, "pass", reason="within the reordering budget", metrics=mets, budget=budget)
    return Finding(CHECK, subject, point, "fail", metrics=mets, budget=budget,
                   reason=f"{point}: {int(over.sum())} of {over.numel()} values over the reordering budget "
                          f"(max |diff| {mets['max_abs_diff']:.3g}, {mets['max_over_budget']:.3g}x its bound)")


# ---- the ranks ---------------------------------------------------------------------------------------

@dataclass
class Job:
    """What every rank gets (picklable): the file, the plans to run, the reference."""

    path: str
    dtype: str
    rules: str
    plans: list[tuple[str, str | None]]  # ("rules", None) | ("engine-shards", DIR) | ("fault", name)
    ref: Reference
    localize: bool = True
    stored: dict[str, torch.dtype] = field(default_factory=dict)  # the engine's narrower storage dtypes
    plant: Plant | None = None  # builds the ("fault", name) plans


@dataclass
class PlanResult:
    plan: str
    findings: list[Finding] = field(default_factory=list)
    first: dict[str, Any] | None = None  # first divergent point and its explanation
    seconds: float = 0.0


def build_plan(spec: tuple[str, str | None], base: tp.Plan, plant: Plant | None) -> tp.Plan:
    kind, arg = spec
    if kind == "rules":
        return base
    if kind == "engine-shards":
        return EngineShards(base, Path(arg))
    if kind == "fault":
        return plant(arg, base)
    raise ValueError(spec)


def _broadcast(obj: Any, rank: int) -> Any:
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _differs(plan: tp.Plan, reference: tp.Plan, name: str, rank: int, chunk: int = 8192) -> bool:
    """Whether this rank's shard of `name` in `plan` is not the rules' beyond the rounding of how it
    was stored (`_stored_bound`; vocab shards a chunk of rows at a time, stopping at the first that differs)."""
    dtype = plan.stored_dtype(name, rank)

    def differ(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape != b.shape or bool(metrics.over_budget(a, b, _stored_bound(b, dtype)).any())

    if plan.split(name).kind != "vocab":
        return differ(plan.shard(name, rank), reference.shard(name, rank))
    lo, hi = tp.vocab_range(plan.cfg.n_vocab, rank, plan.t, plan.rules)
    for r in range(0, hi - lo, chunk):
        rows = torch.arange(r, min(r + chunk, hi - lo))
        if differ(plan.vocab_rows(name, rank, rows), reference.vocab_rows(name, rank, rows)):
            return True
    return False


def _differs_on(plan: tp.Plan, reference: tp.Plan, name: str, rank: int, t: int, device: torch.device) -> list[int]:
    """Ranks whose shard of `name` in `plan` is not the rules' (every rank learns the list)."""
    flag = torch.tensor([int(_differs(plan, reference, name, rank))], device=device)
    flags = [torch.zeros_like(flag) for _ in range(t)]
    dist.all_gather(flags, flag)
    return [r for r, f in enumerate(flags) if int(f)]


def worker(rank: int, t: int, device: torch.device, job: Job) -> list[PlanResult] | None:
    """One rank: every plan of the job, point by point; rank 0 judges and returns the results."""
    from ...gguf import open_gguf
    from ...reference.config import from_gguf

    g = open_gguf(job.path)
    cfg = from_gguf(g)
    weights = fw.Weights(g, dtype=DTYPES[job.dtype], device=device, cache=False)  # a rank keeps only its shards
    if job.stored:
        weights = tp.StoredAs(weights, job.stored)
    base = tp.Plan(weights, cfg, tp.RULES[job.rules], t)
    ref = job.ref
    inputs = {k: v.to(device) for k, v in ref.inputs.items()}
    positions = torch.arange(len(ref.inputs["ids"]), device=device)
    results = []
    for spec in job.plans:
        t0 = time.perf_counter()
        plan = build_plan(spec, base, job.plant)
        label = spec[0] if spec[1] is None else f"{spec[0]}:{spec[1]}"
        res = PlanResult(label)
        runner = tp.Rank(plan, rank, positions)
        used, extra = {}, {}
        for point in ref.points:
            extra[point] = dict(runner.extra)
            got = runner.run(point, inputs)
            used[point] = list(runner.weights.used)
            if rank == 0:
                res.findings.append(judge(point, got.cpu(), ref.want[point], ref.bound[point], label))
        first = _broadcast(next((f.target for f in res.findings if f.status == "fail"), None), rank)
        if first is not None and job.localize:
            res.first = _localize(plan, base, rank, t, device, first, used[first], extra[first], inputs, positions, ref)
        res.seconds = time.perf_counter() - t0
        results.append(res)
    g.close()
    return results if rank == 0 else None


def _localize(plan: tp.Plan, base: tp.Plan, rank: int, t: int, device: torch.device, point: str, used: list[str],
              extra: dict, inputs: dict[str, torch.Tensor], positions: torch.Tensor, ref: Reference) -> dict[str, Any]:
    """Name the tensor (or the missing collective) whose rules' version brings `point` back in budget."""
    differ = {n: r for n in used if (r := _differs_on(plan, base, n, rank, t, device))}
    reduced = [n for n in used if plan.split(n).reduced and not plan.reduces(n)]
    candidates: list[tuple[str, list[str], list[str]]] = [("shards of " + n, [n], []) for n in differ]
    if len(differ) > 1:
        candidates.append(("shards of " + ", ".join(differ), list(differ), []))
    candidates += [(f"the all-reduce after {n}", [], [n]) for n in reduced]
    if len(candidates) > 1:
        candidates.append(("everything the point uses", list(differ), reduced))
    tried = []
    for what, shards, collectives in candidates:
        runner = tp.Rank(tp.Substituted(plan, base, shards, collectives), rank, positions)
        runner.extra = dict(extra)
        got = runner.run(point, inputs)
        ok = None
        if rank == 0:
            f = judge(point, got.cpu(), ref.want[point], ref.bound[point], "substituted")
            tried.append({"substituted": what, "status": f.status, "max_over_budget": f.metrics["max_over_budget"]})
            ok = f.status == "pass"
        if _broadcast(ok, rank):
            return {"point": point, "explained_by": what, "tensors": shards or collectives,
                    "ranks": {n: differ[n] for n in shards}, "kind": "collective" if collectives and not shards
                    else "shards", "tried": tried}
    return {"point": point, "explained_by": None, "tensors": [], "ranks": {},
            "kind": "unexplained", "tried": tried, "shards_differ": {n: r for n, r in differ.items()}}


# ---- the command -------------------------------------------------------------------------------------

@dataclass
class Result:
    findings: list[Finding]
    plans: list[PlanResult]
    reference: Reference
    tp: int
    rules: str
    seconds: float


def prompt_ids(n_vocab: int, n_tokens: int, seed: int) -> torch.Tensor:
    """n_tokens pseudo-random token ids (seeded), spread over the whole vocabulary so that every
    rank's embedding shard is looked up when the vocabulary is split."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_vocab, (n_tokens,), generator=gen)


def _first_finding(res: PlanResult, layer_of: dict[str, str]) -> Finding:
    """The verdict of one plan's forward: the first divergent point and what explains it."""
    first = res.first
    if first is None:
        failed = [f for f in res.findings if f.status == "fail"]
        status = "fail" if failed else "pass"
        return Finding(CHECK, res.plan, "first-divergence", status,
                       reason="every joined point within budget" if not failed else "divergent (not localized)")
    where = layer_of[first["point"]]
    if first["explained_by"] is None:
        expl = (f"first divergence at {where} ({first['point']}); no single substitution of the rules' shards "
                f"or collectives brings it back in budget")
    else:
        ranks = "; ".join(f"{n} differs on ranks {r}" for n, r in first["ranks"].items())
        expl = (f"first divergence at {where} ({first['point']}), explained by {first['explained_by']}"
                + (f" ({ranks})" if ranks else "") + ": with the rules' version the point is within budget")
    return Finding(CHECK, res.plan, "first-divergence", "fail", reason=expl, explanation=expl,
                   metrics={"point": first["point"], "tensors": first["tensors"], "kind": first["kind"]},
                   evidence=first["tried"])


def run(path: Path, t: int, *, rules: str = "vllm", engine_shards: Path | None = None, n_layer: int | None = None,
        n_tokens: int = 8, seed: int = 0, dtype: str = "float32", device: str = "cpu",
        faults: list[str] | None = None, plant: Plant | None = None, localize: bool = True) -> Result:
    """Saved shards (when given) and the tensor-parallel forward of every plan: the engine's saved
    shards, else the rules' own (a self-check of the collectives); `faults` adds planted engine plans,
    each built on the ranks by `plant` (faults/sharding.py `plant`)."""
    from ...gguf import open_gguf
    from ...reference.config import from_gguf

    if t < 2:
        raise InputError(f"--tp {t}: tensor parallelism needs at least 2 ranks")
    if rules not in tp.RULES:
        raise InputError(f"--rules {rules!r}: one of {', '.join(tp.RULES)}")
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: one of {', '.join(DTYPES)}")
    if faults and plant is None:
        raise ValueError("faults need plant (faults/sharding.py plant) to build their plans")
    tp.check_devices(t, device)
    t0 = time.perf_counter()
    with open_gguf(path) as g:
        cfg = from_gguf(g)
        r = tp.RULES[rules]
        tp.local_config(cfg, t)  # heads divisible by T
        findings: list[Finding] = []
        stored: dict[str, torch.dtype] = {}
        if engine_shards is not None:
            base = tp.Plan(fw.Weights(g, dtype=DTYPES[dtype], device=torch.device("cpu"), cache=False), cfg, r, t)
            engine = EngineShards(base, engine_shards)
            findings += compare_saved(engine, base)
            stored = narrower_dtypes(engine, DTYPES[dtype])
        ids = prompt_ids(cfg.n_vocab, n_tokens, seed)
    ref = reference(path, ids, r, n_layer=n_layer, dtype=DTYPES[dtype],
                    device="cuda" if device.startswith("cuda") else "cpu", stored=stored)
    plans = [("engine-shards", str(engine_shards)) if engine_shards else ("rules", None)]
    plans += [("fault", f) for f in faults or ()]
    try:
        results = tp.launch(t, worker, (Job(str(path), dtype, rules, plans, ref, localize, stored, plant),), device=device)
    except tp.RankFailed as e:
        if engine_shards is None:
            raise
        # e.g. a saved shard of the wrong shape: its comparison finding above says which; the forward cannot run
        findings.append(Finding(CHECK, f"engine-shards:{engine_shards}", "forward", "skip",
                                reason=f"skipped: the tensor-parallel forward could not run on the saved shards ({e})"))
        return Result(findings, [], ref, t, rules, time.perf_counter() - t0)
    layer_of = {p: ("the embedding" if p == tp.EMBED else "the logits" if p == tp.LOGITS
                    else f"layer {p.rsplit('-', 1)[1]}") for p in ref.points}
    for res in results:
        findings += res.findings
        findings.append(_first_finding(res, layer_of))
    return Result(findings, results, ref, t, rules, time.perf_counter() - t0)
