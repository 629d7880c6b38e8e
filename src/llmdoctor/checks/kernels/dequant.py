"""`llmdoctor check dequant`: does a dequant kernel give the reference's numbers on this file?

The kernel (a `subjects.kernels` spec, opened by the caller: `open_kernel`, e.g.
subjects.kernels.IsolatedKernel, a child process) receives every selected tensor whole, as an engine
calls it; sampling only decides which blocks are compared (seeded, always the first and the last
block). The reference (gguf-py, `layout_bugs.reference`) is computed only for the compared blocks.
Verdict per tensor, through `metrics`:

- float32 output must be bit-exact;
- reduced-precision output (float16/bfloat16, or float32 whose values are all float16/bfloat16
  numbers: computed in half precision) is judged by `reduced_precision_bound`;
- NaN/inf where the reference is finite fails, except the infinity a reduced precision must give where
  the reference lies beyond its finite range (float16 above 65,504: `Judge.overflowed`), which is reported.

A failing tensor is explained by the first matching candidate of `layout_bugs`, else "unexplained"
with the first differing elements as evidence.
"""

from __future__ import annotations

import fnmatch
import math
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ...errors import InputError
from ...gguf import open_gguf
from ...outcomes import LoadFailed, Outcome
from ..layout import layout_bugs
from .. import metrics
from ..base import Finding

CHECK = "dequant"
DEFAULT_BLOCKS = 256
DEFAULT_TIMEOUT = 120.0
DTYPES = ("float32", "float16", "bfloat16")
# Roundings of the longest chain a correct half-precision dequant kernel evaluates, see below.
ROUNDINGS = 4
# Roundings in the float32 reference itself (gguf-py: d·sc, ·q, - dmin·m).
REFERENCE_ROUNDINGS = 3
_DIAGNOSE_MAX_BLOCKS = 512  # blocks used to name a layout bug (the candidates decode them ~30 times)
_CHUNK_ELEMENTS = 1 << 21  # compared in chunks (bounds the comparison temporaries; with --all the
                           # kernel's whole output still comes back and is held once)
_EVIDENCE = 8  # differing elements shown when no layout bug explains them


def reduced_precision_bound(want: torch.Tensor, m: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |kernel - reference| for a correct kernel computing in `dtype`, f64 [n].

    Derivation (Higham §2.2, rounding model fl(x) = x(1+δ) + η, |δ| <= u, |η| <= η_min):
    every GGUF type dequantizes to y = d·s·q + m, with d a float16 super-block (or block) scale, s an
    integer sub-block scale (1 for legacy types), q an integer quant (or grid/codebook value) and m
    the min term (m = -dmin·mn for K-quants, m stored for Q4_1/Q5_1, 0 otherwise). A kernel working
    in `dtype` (as vLLM's GGUF kernels compute d*q+m in half) rounds at most: (1) d converted to
    `dtype` (exact for float16, a rounding for bfloat16), (2) d·s, (3) (d·s)·q, (4) the add of m; the
    m path has at most 3 roundings (dmin converted, dmin·mn, the same add); a final cast of a float32
    result counts as the rounding it replaces. The integers q, s, mn are exact in both dtypes. So

        |y~ - y| <= γ_4(u)·|d·s·q| + γ_3(u)·|m| + 4·η_min <= γ_c(u)·(|d·q| + |m|) + c·η_min,  c = 4,

    with γ_c = c·u/(1 - c·u), u = 2^-11 (float16) or 2^-8 (bfloat16). The η_min term (2^-25 for
    float16) covers results that underflow to subnormals (tiny d). The reference itself is float32
    with 3 roundings, so the bound adds γ_3(2^-24)·(|d·q| + |m|). |d·q| is computed as |y - m| from
    the reference (its float32 error is inside that extra term). An element near cancellation
    (d·q ≈ -m) can be thousands of ulps of y off and still be within this bound: the bound, not an
    ulp count, is the judge.
    """
    want = want.to(torch.float64).reshape(-1)
    mm = torch.zeros_like(want) if m is None else m.to(torch.float64).reshape(-1)
    magnitude = (want - mm).abs() + mm.abs()  # |d·q| + |m|
    return (metrics.rounding_bound(magnitude, dtype, ROUNDINGS)
            + metrics.rounding_bound(magnitude, torch.float32, REFERENCE_ROUNDINGS))


def _representable(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Every finite value of x (float32) is exactly a `dtype` number (checked in chunks)."""
    flat = x.reshape(-1)
    for i in range(0, flat.numel(), _CHUNK_ELEMENTS):
        c = flat[i:i + _CHUNK_ELEMENTS]
        c = c[torch.isfinite(c)]
        if not bool((c.to(dtype).to(x.dtype) == c).all()):
            return False
    return True


# Types whose dequantization is a pure conversion, no arithmetic: float32 output must be exact even
# when its values happen to lie on a half-precision grid (a kernel that rounds them is lossy, not
# "reduced-precision arithmetic").
_CONVERSIONS = {T.F32, T.F16, T.BF16}


def _working_precision(got: torch.Tensor) -> Optional[torch.dtype]:
    """The precision an output that is not bit-exact is judged in, or None (it must be bit-exact).

    float32 values that are all bfloat16 (or else all float16) numbers were computed in that
    precision (bfloat16 first: its numbers in float16's range are float16 numbers too, while float16
    results essentially never all land on the coarser bfloat16 grid); float64 output may be more
    exact than the float32 reference, so it is held to float32 rounding.
    """
    if got.dtype == torch.float64:
        return torch.float32
    if got.dtype == torch.float32:
        return next((h for h in (torch.bfloat16, torch.float16) if _representable(got, h)), None)
    return None


@dataclass
class Judge:
    """How one tensor's output is judged: bit-exact, or the reduced-precision bound in `precision`."""

    precision: Optional[torch.dtype]  # None: bit-exact

    def bad(self, got: torch.Tensor, want: torch.Tensor, m: Optional[torch.Tensor]) -> torch.Tensor:
        """bool [n]: elements that fail. got any float dtype; want float32 reference values."""
        if self.precision is None:
            return _exact_mismatch(got, want)
        return (metrics.over_budget(got, want, reduced_precision_bound(want, m, self.precision))
                & ~self.overflowed(got, want))

    def overflowed(self, got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
        """bool [n]: the reference lies beyond the working precision's finite range (it rounds to ±inf
        there: float16 from 65,520 on) and the kernel gives that same infinity, as arithmetic in that
        precision must. Never with the bit-exact rule (float32 holds every reference value)."""
        g, w = got.to(torch.float64).reshape(-1), want.reshape(-1)
        if self.precision is None:
            return torch.zeros_like(g, dtype=torch.bool)
        edge = w.to(self.precision).to(torch.float64)  # ±inf where |want| rounds past the largest finite
        return torch.isinf(edge) & torch.isfinite(w) & (g == edge)


def _exact_mismatch(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    if got.dtype == torch.float32:
        return metrics.bit_mismatch(got, want)
    g, w = got.to(torch.float64).reshape(-1), want.to(torch.float64).reshape(-1)
    return ~((g == w) | (torch.isnan(g) & torch.isnan(w)))


def choose_blocks(n_blocks: int, n: int, seed: int, name: str) -> np.ndarray:
    """Sorted block indices to compare: first, last and n-2 others, seeded per (seed, tensor name)
    so that a tensor's sample does not depend on which other tensors are selected."""
    if n >= n_blocks:
        return np.arange(n_blocks, dtype=np.int64)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    inner = rng.choice(n_blocks - 2, size=max(n - 2, 0), replace=False) + 1
    return np.unique(np.concatenate([[0, n_blocks - 1], inner]).astype(np.int64))


@dataclass
class Result:
    kernel: str
    device: str
    dtype: Optional[str]
    findings: list[Finding] = field(default_factory=list)
    by_type: dict[str, dict[str, Any]] = field(default_factory=dict)
    loaded: bool = True
    seconds: float = 0.0
    restarts: int = 0


def _select(g: Any, only: Optional[str]) -> list[Any]:
    tensors = [t for t in g.tensors if only is None or fnmatch.fnmatchcase(t.name, only)]
    if not tensors:
        raise InputError(f"--only {only!r} matches no tensor of {g.path}")
    return tensors


def run(path: Path, open_kernel: Callable[..., Any], *, kernel: str = "torch", device: str = "cpu",
        dtype: Optional[str] = None, only: Optional[str] = None, blocks: int = DEFAULT_BLOCKS,
        all_blocks: bool = False, seed: int = 0, timeout: float = DEFAULT_TIMEOUT,
        on_tensor: Optional[Callable[[int, int, str], None]] = None) -> Result:
    """Check `kernel` against the reference on the tensors of `path` (see the module docstring).
    `open_kernel(kernel, device=, dtype=, timeout=)` gives the kernel as a context manager with `start()`
    (raises LoadFailed), `dequantize(raw, qtype, shape, block_size, blocks) -> Outcome` and `restarts`
    (subjects.kernels.IsolatedKernel; a malformed spec raises InputError there, before anything else)."""
    subject = open_kernel(kernel, device=device, dtype=dtype, timeout=timeout)
    if dtype is not None and dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise InputError(f"--device {device!r}: expected cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device cuda: CUDA is not available here (torch {torch.__version__})")
    if seed < 0:
        raise InputError(f"--seed {seed}: must be >= 0")
    if timeout <= 0:
        raise InputError(f"--timeout {timeout:g}: must be > 0")
    if blocks < 1 and not all_blocks:
        raise InputError(f"--blocks {blocks}: must be at least 1")
    res = Result(kernel, device, dtype)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the comparisons here are small: thread hand-offs would cost more than they save
    try:
        _run(res, subject, path, only, blocks, all_blocks, seed, on_tensor)
    finally:
        torch.set_num_threads(threads)
    res.seconds = time.perf_counter() - t0
    return res


def _run(res: Result, subject: Any, path: Path, only: Optional[str], blocks: int, all_blocks: bool, seed: int,
         on_tensor: Optional[Callable[[int, int, str], None]]) -> None:
    kernel = res.kernel
    with open_gguf(path) as g, subject:
        tensors = _select(g, only)
        try:
            subject.start()
        except LoadFailed as e:
            if e.kind == "InputError":
                raise InputError(str(e)) from None
            res.loaded = False
            res.findings.append(Finding(CHECK, kernel, "load", "skip", reason=f"kernel {kernel!r} could not run: {e}"))
            return
        dead: Optional[str] = None
        for i, t in enumerate(tensors):
            if on_tensor:
                on_tensor(i, len(tensors), t.name)
            if dead is not None:
                f = Finding(CHECK, kernel, t.name, "skip", reason=dead)
            else:
                try:
                    f = _check_tensor(subject, t, kernel, blocks, all_blocks, seed)
                except LoadFailed as e:  # the fresh child after a crash could not start
                    dead = f"kernel could not be restarted after a crash: {e}"
                    f = Finding(CHECK, kernel, t.name, "skip", reason=dead)
            res.findings.append(f)
            _add_to_summary(res.by_type, t.type.name, f)
        res.restarts = subject.restarts


def _check_tensor(subject: Any, t: Any, kernel: str, n_blocks: int, all_blocks: bool, seed: int) -> Finding:
    name, q = t.name, T(t.type)
    base = {"type": q.name, "shape": list(t.shape), "offset": t.offset, "n_blocks": t.n_blocks}

    def finding(status: str, reason: str = "", **kw: Any) -> Finding:
        kw["metrics"] = {**base, **kw.get("metrics", {})}
        return Finding(CHECK, kernel, name, status, reason=reason,
                       hypothesis=f"kernel {kernel!r} dequantizes {name} ({q.name}) to the reference's values", **kw)

    if not t.supported:
        return finding("skip", f"{q.name} in a big-endian file has no defined block layout")
    if t.n_blocks == 0:
        return finding("skip", "empty tensor: nothing to compare")
    if q not in layout_bugs.reference_types():
        return finding("skip", f"no reference: gguf-py cannot dequantize {q.name}")
    idx = np.arange(t.n_blocks, dtype=np.int64) if all_blocks else choose_blocks(t.n_blocks, n_blocks, seed, name)
    out = subject.dequantize(t.data, int(q), list(t.shape), t.block_size, None if all_blocks else idx)
    if out.status != "ok":
        return _fault_finding(finding, out)
    got = torch.frombuffer(out.payload, dtype=getattr(torch, out.header["dtype"]))
    got = got.reshape(len(idx), t.block_size)  # [k, block_size]
    tensor = layout_bugs.Tensor(q, tuple(t.shape), t.data)
    precision = got.dtype if got.dtype in (torch.float16, torch.bfloat16) else None
    tally = _compare(got, tensor, idx, Judge(precision))
    if precision is None and tally.mismatches and q not in _CONVERSIONS:
        precision = _working_precision(got)
        if precision is not None:
            tally = _compare(got, tensor, idx, Judge(precision))
    judge = Judge(precision)
    mets = {**tally.metrics(idx, t), "output_dtype": out.header["dtype"], "output_device": out.header["device"],
            "kernel_seconds": out.header.get("seconds"), "nonfinite_in_output": out.header.get("nonfinite", 0)}
    budget = {"rule": "bit-exact" if precision is None else "reduced-precision bound",
              **({} if precision is None else {
                  "precision": str(precision).removeprefix("torch."), "roundings": ROUNDINGS,
                  "formula": "|err| <= gamma_c(u)*(|d*q|+|m|) + c*eta_min + gamma_3(2^-24)*(|d*q|+|m|)"})}
    stray = _nonfinite_elsewhere(out, tensor, judge)
    if not tally.failing and not stray:
        how = ("bit-exact" if precision is None else "within float32 rounding" if precision == torch.float32
               else "reduced-precision arithmetic")
        expl = "" if precision is None else (
            f"{how} ({budget['precision']}): within the derived rounding bound, not a layout bug")
        if tally.overflow:  # right for the kernel's precision, and worth a reader's eye: the weights do not fit it
            expl += (f"; {tally.overflow} elements beyond {budget['precision']}'s range (|reference| up to "
                     f"{tally.overflow_ref_max:.6g}) come out ±inf, as {budget['precision']} arithmetic must: "
                     f"this tensor does not fit a {budget['precision']} dequantization")
        return finding("pass", how, metrics=mets, budget=budget, explanation=expl)
    if not tally.failing:
        return finding("fail", f"non-finite output where the reference is finite ({len(stray)} shown)",
                       metrics=mets, budget=budget, evidence=stray,
                       explanation="the kernel writes NaN/inf outside the compared blocks")
    reason, expl, evidence = _diagnose(got, tally, idx, tensor, judge)
    return finding("fail", reason, metrics=mets, budget=budget, explanation=expl, evidence=evidence + stray)


def _fault_finding(finding: Callable[..., Finding], out: Outcome) -> Finding:
    if out.status == "unsupported":
        return finding("skip", f"kernel does not support this type: {out.message}")
    what = {"raised": "kernel raised", "crashed": "kernel crashed", "timeout": "kernel hung",
            "contract": "contract violation"}.get(out.status, out.status)
    fresh = "; the rest of the tensors go to a fresh child" if out.status in ("crashed", "timeout") else ""
    return finding("fail", f"{what}: {out.message}", explanation=f"{what} on this tensor{fresh}")


@dataclass
class _Tally:
    """Metrics of one tensor accumulated over chunks of compared blocks (rows of `got`)."""

    judge: Judge
    n: int = 0
    mismatches: int = 0  # not bit-identical
    failing: int = 0  # judged bad (= mismatches when bit-exact is the rule)
    nonfinite: int = 0  # NaN/inf where the reference is finite (other than `overflow`)
    overflow: int = 0  # ±inf where the reference is beyond the working precision's range (Judge.overflowed)
    overflow_ref_max: float = 0.0  # the largest |reference| among them
    sum_sq_err: float = 0.0
    sum_sq_ref: float = 0.0
    worst: tuple[float, int, float, float] = (-1.0, 0, 0.0, 0.0)  # (|diff|, flat row-major index in got, got, want)
    bound_used: float = 0.0
    bits: Optional[dict[str, Any]] = None
    bad_rows: list[int] = field(default_factory=list)  # rows with failing elements (first few)
    evidence: list[tuple[int, float, float]] = field(default_factory=list)  # (flat index in got, got, want)

    def add(self, start: int, got: torch.Tensor, want: torch.Tensor, m: Optional[torch.Tensor]) -> None:
        """got, want, m: [r, block_size] for rows start..start+r of the compared blocks."""
        bs = want.shape[1]
        diff = metrics.abs_diff(got, want)  # f64 [r*bs]
        mism = _exact_mismatch(got, want)
        bad = self.judge.bad(got, want, m)
        self.n += want.numel()
        self.mismatches += int(mism.sum())
        self.failing += int(bad.sum())
        over = self.judge.overflowed(got, want)
        self.nonfinite += int((metrics.nonfinite_where_finite(got, want) & ~over).sum())
        if over.any():
            self.overflow += int(over.sum())
            self.overflow_ref_max = max(self.overflow_ref_max, float(want.reshape(-1)[over].abs().max()))
        err = diff.nan_to_num(math.inf)
        sq_err, sq_ref = metrics.sq_sums(got, want)
        self.sum_sq_err += sq_err
        self.sum_sq_ref += sq_ref
        if err.numel():
            j = int(err.argmax())
            if float(err[j]) > self.worst[0]:
                self.worst = (float(err[j]), start * bs + j, float(got.reshape(-1)[j]), float(want.reshape(-1)[j]))
        if self.judge.precision is not None:
            bound = reduced_precision_bound(want, m, self.judge.precision)
            self.bound_used = max(self.bound_used, float((err / bound).max()) if err.numel() else 0.0)
        if got.dtype == torch.float32 and mism.any():
            self._add_bits(metrics.differing_bits(got, want))
        if bad.any() and len(self.bad_rows) < _DIAGNOSE_MAX_BLOCKS // 4:
            rows = bad.reshape(-1, bs).any(dim=1).nonzero().flatten()
            self.bad_rows += (rows[: _DIAGNOSE_MAX_BLOCKS // 4 - len(self.bad_rows)] + start).tolist()
        if bad.any() and len(self.evidence) < _EVIDENCE:
            for j in bad.nonzero().flatten()[: _EVIDENCE - len(self.evidence)].tolist():
                self.evidence.append((start * bs + j, float(got.reshape(-1)[j]), float(want.reshape(-1)[j])))

    def _add_bits(self, b: dict[str, Any]) -> None:
        if self.bits is None:
            self.bits = b
            return
        for k in ("elements", "sign", "exponent", "mantissa"):
            self.bits[k] += b[k]
        self.bits["per_bit"] = [x + y for x, y in zip(self.bits["per_bit"], b["per_bit"])]
        self.bits["max_ulp"] = max(self.bits["max_ulp"], b["max_ulp"])

    def metrics(self, idx: np.ndarray, t: Any) -> dict[str, Any]:
        rel = metrics.rel_l2_from_sums(self.sum_sq_err, self.sum_sq_ref)
        m: dict[str, Any] = {
            "compared_blocks": len(idx), "compared_elements": self.n,
            "max_abs_diff": max(self.worst[0], 0.0), "rel_l2": rel,
            "mismatches": self.mismatches, "mismatch_fraction": self.mismatches / max(self.n, 1),
            "failing_elements": self.failing, "nonfinite_where_finite": self.nonfinite,
            "sum_sq_err": self.sum_sq_err, "sum_sq_ref": self.sum_sq_ref,
        }
        if self.mismatches:
            _, j, g, w = self.worst
            blk = int(idx[j // t.block_size])
            m["worst_block"] = {"index": blk, "file_offset": t.offset + blk * t.type_size,
                                "element": _element(t.shape, blk * t.block_size + j % t.block_size),
                                "got": g, "want": w}
        if self.bits is not None:
            m["differing_bits"] = self.bits
        if self.judge.precision is not None:  # how much of the rounding bound the worst element uses
            m["bound_used"] = self.bound_used
        if self.overflow:
            m["overflow_elements"], m["overflow_reference_max"] = self.overflow, self.overflow_ref_max
        return m


def _element(shape: tuple[int, ...], flat: int) -> list[int]:
    return [int(v) for v in np.unravel_index(flat, shape)]


def _compare(got: torch.Tensor, t: layout_bugs.Tensor, idx: np.ndarray, judge: Judge) -> _Tally:
    """Reference (gguf-py) for the compared blocks, chunk by chunk, against got [k, block_size]."""
    tally = _Tally(judge)
    step = max(1, _CHUNK_ELEMENTS // t.block_size)
    for start in range(0, len(idx), step):
        blocks = t.blocks(idx[start:start + step])  # uint8 [r, type_size]
        want = torch.from_numpy(layout_bugs.reference(t.qtype, blocks))  # f32 [r, block_size]
        m = layout_bugs.min_part(t.qtype, blocks)
        tally.add(start, got[start:start + step], want, None if m is None else torch.from_numpy(m))
    return tally


def _nonfinite_elsewhere(out: Outcome, t: layout_bugs.Tensor, judge: Judge) -> list[dict[str, Any]]:
    """The kernel's non-finite elements (anywhere in the tensor) where the reference is finite, but for
    the infinities the judged precision must give (Judge.overflowed)."""
    at = np.asarray(out.header.get("nonfinite_at", []), dtype=np.int64)
    if not at.size:
        return []
    ref = np.asarray(t.ref_elements(at), dtype=np.float32)
    got = np.asarray(out.header["nonfinite_values"], dtype=np.float64)
    over = judge.overflowed(torch.from_numpy(got), torch.from_numpy(ref)).numpy()
    return [{"element": _element(t.shape, int(i)), "got": float(g), "want": float(r)}
            for i, g, r, o in zip(at, got, ref, over) if np.isfinite(r) and not o]


def _diagnose(got: torch.Tensor, tally: _Tally, idx: np.ndarray, t: layout_bugs.Tensor,
              judge: Judge) -> tuple[str, str, list[Any]]:
    """Name the layout bug (on at most _DIAGNOSE_MAX_BLOCKS of the compared blocks) or show evidence."""
    k = len(idx)
    rows = np.arange(k)
    if k > _DIAGNOSE_MAX_BLOCKS:
        others = np.random.default_rng(0).choice(k, _DIAGNOSE_MAX_BLOCKS // 2, replace=False)
        rows = np.unique(np.concatenate([[0, k - 1], tally.bad_rows, others]).astype(np.int64))
    sub_got = got[torch.from_numpy(rows)]
    m_np = layout_bugs.min_part(t.qtype, t.blocks(idx[rows]))
    sub_m = None if m_np is None else torch.from_numpy(m_np)

    def matches(expected: np.ndarray, keep: np.ndarray) -> bool:
        kk = torch.from_numpy(keep)
        exp = torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32))
        return not judge.bad(sub_got[kk], exp[kk], None if sub_m is None else sub_m[kk]).any()

    reason = f"{tally.failing} of {tally.n} compared elements differ" + (
        "" if judge.precision is None else f" beyond the {str(judge.precision).removeprefix('torch.')} rounding bound")
    if tally.nonfinite:
        reason += " (NaN/inf where the reference is finite)"
    cand = layout_bugs.explain(t, idx[rows], matches)
    if cand is not None:
        return f"{reason}: layout bug: {cand.name}", f"layout bug: {cand.name} ({cand.detail})", []
    bs = t.block_size
    evidence = [{"element": _element(t.shape, int(idx[j // bs]) * bs + j % bs), "got": g, "want": w}
                for j, g, w in tally.evidence]
    return f"{reason}: unexplained", "unexplained: no candidate layout bug reproduces the output", evidence


def _add_to_summary(by_type: dict[str, dict[str, Any]], tname: str, f: Finding) -> None:
    s = by_type.setdefault(tname, {"tensors": 0, "passed": 0, "failed": 0, "skipped": 0,
                                   "compared_elements": 0, "mismatches": 0, "max_abs_diff": 0.0,
                                   "rel_l2": 0.0, "_err": 0.0, "_ref": 0.0})
    s["tensors"] += 1
    s[{"pass": "passed", "fail": "failed", "skip": "skipped"}[f.status]] += 1
    mt = f.metrics
    if "compared_elements" not in mt:
        return
    s["compared_elements"] += mt["compared_elements"]
    s["mismatches"] += mt["mismatches"]
    if "worst_block" in mt and mt["max_abs_diff"] >= s["max_abs_diff"]:
        s["worst_block"] = {"tensor": f.target, **mt["worst_block"]}
    s["max_abs_diff"] = max(s["max_abs_diff"], mt["max_abs_diff"])
    s["_err"] += mt["sum_sq_err"]
    s["_ref"] += mt["sum_sq_ref"]
    s["rel_l2"] = metrics.rel_l2_from_sums(s["_err"], s["_ref"])
    if "differing_bits" in mt:
        bits = s.setdefault("differing_bits", {"elements": 0, "sign": 0, "exponent": 0, "mantissa": 0, "max_ulp": 0})
        for k in ("elements", "sign", "exponent", "mantissa"):
            bits[k] += mt["differing_bits"][k]
        bits["max_ulp"] = max(bits["max_ulp"], mt["differing_bits"]["max_ulp"])


def summary(res: Result) -> dict[str, dict[str, Any]]:
    """Per-type totals without the internal accumulators."""
    return {k: {**{kk: vv for kk, vv in v.items() if not kk.startswith("_")},
                "mismatch_fraction": v["mismatches"] / max(v["compared_elements"], 1)}
            for k, v in res.by_type.items()}
