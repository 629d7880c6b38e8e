"""Discrete choices an engine makes inside the model, judged against the reference's scores: the keys a
DSA indexer selects per query (GLM-5's glm-dsa) and the experts a MoE router picks per token. Neither
choice is unique where scores tie or nearly tie, so each is judged by whether the scores *allow* it,
within what the engine's own arithmetic (the emulated run's) moves a score."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .. import metrics
from .layers import K, PointError, off_by

# Capture points of a layer that come before its MoE router (which reads the normed FFN input).
BEFORE_ROUTER = frozenset({"attn_norm", "kqv_out", "ffn_inp"})


def selection_disagreement(scores: Any, selected: Any, top_k: int, rel_tol: float = 1e-5) -> float:
    """Fraction of queries whose selection is not a top-k set of the reference's own scores
    (selection_misses, over every row)."""
    return float(selection_misses(scores, selected, top_k, rel_tol).mean()) if len(scores) else 0.0


def selection_misses(scores: Any, selected: Any, top_k: int, rel_tol: float = 1e-5) -> Any:
    """bool [T]: the queries whose selection is not a top-k set of the reference's own scores. A row
    agrees when its distinct, in-range, visible picks are min(k, visible keys) many, include every
    visible key scoring above the k-th best and none scoring below it (by more than `rel_tol` of the
    row's largest |score|): keys tied with the k-th best (ReLU index scores are often exactly 0) may be
    picked either way. Duplicates, padding indices, future keys and short rows therefore disagree.
    scores: float [T, S] (the reference's index scores, -inf where not visible); selected: int [T, k']."""
    sc = np.asarray(scores, dtype=np.float64)
    sel = np.asarray(selected, dtype=np.int64)
    t_n, s_n = sc.shape
    k = min(top_k, s_n)
    if sel.ndim != 2 or sel.shape[0] != t_n or sel.shape[1] != k:
        return np.ones(t_n, dtype=bool)
    finite = np.where(np.isfinite(sc), sc, -np.inf)
    n_visible = np.isfinite(finite).sum(axis=1)  # [T]
    kth = -np.sort(-finite, axis=1)[:, k - 1]  # [T]: the k-th best visible score (-inf if fewer)
    tol = rel_tol * np.max(np.abs(np.where(np.isfinite(sc), sc, 0.0)), axis=1)  # [T]
    # each row's distinct visible picks (a row at a time in Python took ~80 s on GLM-5's 2,304 x 2,048)
    ok = (sel >= 0) & (sel < s_n)
    got = np.take_along_axis(finite, np.where(ok, sel, 0), axis=1)  # [T, k] the picks' scores
    ok &= np.isfinite(got)
    order = np.sort(np.where(ok, sel, -1), axis=1)  # [T, k] invalid picks first, as -1
    first = order >= 0
    first[:, 1:] &= order[:, 1:] != order[:, :-1]  # [T, k] the first of each distinct valid pick
    picked = np.take_along_axis(finite, np.maximum(order, 0), axis=1)  # [T, k]
    count_ok = first.sum(axis=1) == np.minimum(k, n_visible)
    above = finite > (kth + tol)[:, None]  # [T, S] keys that must be picked
    picked_above = (first & (picked > (kth + tol)[:, None])).sum(axis=1)
    picked_below = (first & (picked < (kth - tol)[:, None])).any(axis=1)
    return ~count_ok | (picked_above != above.sum(axis=1)) | picked_below


def routing_tolerance(ref_scores: Any, emu_scores: Any) -> float:
    """How far apart two experts' selection scores may be and still swap places in a healthy engine: the
    emulated run's largest score error (its arithmetic on the same routing), counted for both experts
    of a comparison, times the layer budget's K, plus a few float32 roundings of the largest score."""
    ref, emu = np.asarray(ref_scores, dtype=np.float64), np.asarray(emu_scores, dtype=np.float64)
    d = float(np.max(np.abs(emu - ref))) if ref.size else 0.0
    return K * 2 * d + 8 * 2.0**-24 * float(np.max(np.abs(ref), initial=0.0))


def routing_inadmissible(scores: Any, chosen: Any, k: int, tol: float, n_group: int = 1,
                         topk_group: int = 1) -> Any:
    """bool [T]: positions whose chosen experts are no top-k choice the reference's selection scores
    allow within `tol` (routing_tolerance). Ungrouped: every chosen expert scores at least the best
    unchosen one minus tol. Grouped (DeepSeek-V3's n_group / topk_group): the chosen experts' groups,
    filled up with the best other groups, are a top-topk_group set of group scores within 2 tol (a group
    score sums two experts', reference/arch_deepseek.group_scores), and the experts are a top-k set within
    those groups. Duplicates, out-of-range ids and a wrong count are inadmissible.
    scores: float [T, E]; chosen: int [T, k]."""
    import torch

    from ...reference.arch_deepseek import group_scores

    sc = np.asarray(scores, dtype=np.float64)
    sel = np.asarray(chosen, dtype=np.int64)
    t_n, e_n = sc.shape
    if sel.ndim != 2 or sel.shape != (t_n, k):
        return np.ones(t_n, dtype=bool)
    grouped = n_group > 1 and e_n % n_group == 0
    gs = group_scores(torch.from_numpy(sc), n_group).numpy() if grouped else None  # [T, G]
    per = e_n // n_group if grouped else e_n
    bad = np.zeros(t_n, dtype=bool)
    for t in range(t_n):
        picks = {int(j) for j in sel[t]}
        if len(picks) != k or not all(0 <= j < e_n for j in picks):
            bad[t] = True
            continue
        pool = np.arange(e_n)
        if grouped:
            mine = {j // per for j in picks}
            rest = [g for g in np.argsort(-gs[t], kind="stable") if g not in mine]
            keep = sorted(mine | set(rest[: max(topk_group - len(mine), 0)]))
            out = [g for g in range(n_group) if g not in keep]
            if len(mine) > topk_group or (out and gs[t, keep].min() < gs[t, out].max() - 2 * tol):
                bad[t] = True
                continue
            pool = np.concatenate([np.arange(g * per, (g + 1) * per) for g in keep])
        unchosen = [j for j in pool if j not in picks]
        bad[t] = bool(unchosen) and sc[t, sorted(picks)].min() < sc[t, unchosen].max() - tol
    return bad


def routing_limit(noise: float, n_positions: int) -> float:
    """Most disagreement a healthy engine shows in a discrete choice (the DSA indexer's key selections):
    its own arithmetic flips near-tied decisions as often as the emulated run does (`noise`), give or
    take three binomial standard errors (with at least one flip's worth of rate, so a noiseless
    emulation does not demand perfection)."""
    p = max(noise, 1.0 / max(n_positions, 1))
    return noise + 3 * math.sqrt(p * (1 - p) / max(n_positions, 1))


# A healthy engine's chance of any alarm of the per-key DSA statistic over the whole diagnosis (issue 35).
FAMILY_LEVEL = 1e-3


def _normal_sf(z: np.ndarray) -> np.ndarray:
    """P(N(0, 1) > z), elementwise."""
    return 0.5 * np.vectorize(math.erfc)(np.asarray(z, dtype=np.float64) / math.sqrt(2.0))


def _normal_isf(p: float) -> float:
    """z with P(N(0, 1) > z) = p (bisection on erfc: p down to 1e-300)."""
    lo, hi = -40.0, 40.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2.0)) > p else (lo, mid)
    return (lo + hi) / 2


def poisson_allowance(lam: float, level: float) -> int:
    """The smallest count a with P(Poisson(lam) > a) <= level."""
    a, term = 0, math.exp(-lam)
    cdf = term
    while 1.0 - cdf > level and a < 10_000_000:
        a += 1
        term *= lam / a
        cdf += term
    return a


def wrong_picks(scores: Any, selected: Any, emu_scores: Any, top_k: int) -> dict[str, Any]:
    """The per-key statistic of a DSA layer over its queries that choose (they see more than top_k keys): a
    pick is *wrong* when its reference score falls below the k-th best by more than the engine's score error
    could move it (or it is no valid, visible, distinct key). The score error of query t: the emulated run's
    RMS score error over the keys t sees, sigma_t (the engine's arithmetic, FP8 indexer included, on the
    same scores); a pick of key j over the k-th key i needs e_j - e_i >= gap, of scale sqrt(2) sigma_t,
    widened by the emulated run's own tail (its largest |e| / sigma_t over every score against the Gaussian
    expectation for that many: never narrowed). A pick is wrong beyond that scale s_t (plus a float32
    floor). A healthy engine still makes a wrong pick of a key j with probability at most
    P(N(0, 1) > gap_j / s_t), so the expected healthy count is at most lam = the sum of that over every
    visible key below the k-th by more than s_t (queries x keys, from the reference's own scores): the
    allowance is Poisson(lam)'s count exceeded with probability `level` (set by dsa_rows for the whole
    diagnosis). Where the FP8 indexer makes exact top-k sets rare, picks far below the k-th still stand out.
    Returns {"wrong", "picks", "allowance", "expected" (lam), "scale" (the median s_t), "queries"}."""
    sc = np.asarray(scores, dtype=np.float64)
    em = np.asarray(emu_scores, dtype=np.float64)
    sel = np.asarray(selected, dtype=np.int64)
    t_n, s_n = sc.shape
    k = min(top_k, s_n)
    visible = np.isfinite(sc)
    choosing = visible.sum(axis=1) > k  # [T]
    out = {"wrong": 0, "picks": 0, "expected": 0.0, "scale": 0.0, "queries": int(choosing.sum())}
    if not choosing.any() or sel.ndim != 2 or sel.shape[0] != t_n:
        return {**out, "allowance": 0, "level": None}
    sc, em, sel, visible = sc[choosing], em[choosing], sel[choosing], visible[choosing]
    finite = np.where(visible, sc, -np.inf)
    kth = -np.sort(-finite, axis=1)[:, k - 1]  # [Tc]
    err = np.subtract(em, sc, out=np.zeros_like(sc), where=visible & np.isfinite(em))  # [Tc, S] the emulated
    # run's score error
    n_vis = visible.sum(axis=1)
    sigma = np.sqrt((err * err).sum(axis=1) / n_vis)  # [Tc]
    n_scores = int(n_vis.sum())
    z = np.where(sigma[:, None] > 0, np.abs(err) / np.where(sigma > 0, sigma, 1.0)[:, None], 0.0)
    tail = max(1.0, float(z.max()) / _normal_isf(0.5 / n_scores))
    floor = 8 * 2.0**-24 * np.max(np.where(visible, np.abs(sc), 0.0), axis=1)  # [Tc]
    scale = tail * math.sqrt(2.0) * sigma + floor  # [Tc]
    gap = kth[:, None] - finite  # [Tc, S] how far below the k-th each key scores (inf: not visible)
    beyond = visible & (gap > scale[:, None])
    lam = float(_normal_sf(gap[beyond] / np.broadcast_to(scale[:, None], gap.shape)[beyond]).sum())
    ok = (sel >= 0) & (sel < s_n)
    picked_gap = np.take_along_axis(gap, np.where(ok, sel, 0), axis=1)  # [Tc, k]
    order = np.sort(np.where(ok, sel, -1), axis=1)
    dup = np.zeros_like(ok)
    dup[:, 1:] = (order[:, 1:] == order[:, :-1]) & (order[:, 1:] >= 0)
    wrong = ~ok | ~(picked_gap <= scale[:, None])  # invalid, invisible (gap inf) or beyond the scale
    return {**out, "wrong": int(wrong.sum() + dup.sum()), "picks": int(sel.size), "expected": lam,
            "scale": float(np.median(scale)), "allowance": 0, "level": None}


def dsa_rows(n_layer: int, top_k: int, ref_caps: Mapping[str, Any], emu_caps: Mapping[str, Any],
             engine_caps: Mapping[str, Any]) -> list[dict]:
    """Per indexer layer, the engine's picks judged in two groups of queries: those that see more keys than
    they keep ("disagreement", "noise", "limit", "queries": where the indexer chooses) and those that see at
    most top_k keys and must keep them all ("short": the same four). A group's noise is the emulated run's
    own top k against the same scores; the choosing group's limit is routing_limit over its size, the short
    group's the noise itself (their selection is determined: no rounding changes it). Pooled with the
    short rows, which a healthy engine never misses, the choosing rows' rate would be diluted below any limit
    (on the H200's GLM-5 prompt, 128 of 200 rows are short). A shared layer uses the last full layer's
    scores. llama.cpp's view of the selection that layer il's attention reads is "top_k-{il} (view)" (its
    own indexer's or the shared one's); the bare "top_k-{il}" node is not reliably that layer's."""
    rows, scores, emu_scores = [], None, None
    for il in range(n_layer):
        scores = ref_caps.get(f"indexer_score-{il}", scores)
        emu_scores = emu_caps.get(f"indexer_score-{il}", emu_scores)
        engine_sel = engine_caps.get(f"top_k-{il} (view)", engine_caps.get(f"top_k-{il}"))
        if scores is not None and emu_scores is not None and engine_sel is not None:
            # the noise: what the engine's arithmetic would pick from the same state (the emulated run's
            # own top k; its selections themselves are the engine's, replayed, see diagnose/replay.py)
            emu_sel = np.argsort(-np.asarray(emu_scores, dtype=np.float64), axis=1, kind="stable")[:, :top_k]
            k = min(top_k, scores.shape[1])
            engine_bad, emu_bad = selection_misses(scores, engine_sel, top_k), selection_misses(scores, emu_sel, k)
            choosing = np.isfinite(np.asarray(scores, dtype=np.float64)).sum(axis=1) > k  # [T]

            def group(mask, limit):
                n, noise = int(mask.sum()), float(emu_bad[mask].mean()) if mask.any() else 0.0
                return {"disagreement": float(engine_bad[mask].mean()) if n else 0.0, "noise": noise,
                        "limit": limit(noise, n), "queries": n}

            # a short query's selection is determined (every key it sees), which no rounding changes: it may
            # miss no more than the emulated run does (none), without routing_limit's one-flip allowance
            rows.append({"layer": il, **group(choosing, routing_limit), "short": group(~choosing, lambda p, n: p),
                         "keys": wrong_picks(scores, engine_sel, emu_scores, top_k)})
    for r in rows:  # the per-key allowance, set for every judged layer together (Bonferroni over layers)
        r["keys"]["level"] = FAMILY_LEVEL / len(rows)
        r["keys"]["allowance"] = poisson_allowance(r["keys"]["expected"], r["keys"]["level"])
    return rows


def dsa_misses(row: dict) -> str:
    """Why a dsa_rows row fails ("" when it passes): a group of queries beyond its limit, or the picks far
    below the k-th score beyond their allowance (wrong_picks)."""
    for what, g in (("of the queries that choose", row), ("of the queries that see at most top-k keys",
                                                           row["short"])):
        if g["disagreement"] > g["limit"]:
            return (f"{g['disagreement']:.0%} {what} ({g['queries']}; its arithmetic explains "
                    f"{g['limit']:.0%})")
    keys = row.get("keys")
    if keys and keys["wrong"] > keys["allowance"]:
        return (f"{keys['wrong']} of {keys['picks']} picks of the {keys['queries']} queries that choose score below "
                f"the k-th best by more than the engine's score error ({keys['scale']:.3g}), where a healthy "
                f"engine makes at most {keys['allowance']} (false-alarm chance {keys['level']:.2g})")
    return ""


def moe_rows(n_layer: int, moe: Any, ref_caps: Mapping[str, Any], emu_caps: Mapping[str, Any],
             engine_caps: Mapping[str, Any]) -> list[dict]:
    """Per MoE layer the engine exposes: {"layer", "disagreement" (positions whose experts the scores do
    not allow within routing_tolerance), "tolerance", "positions" (the first 8 of those), "near_ties_taken"
    (experts not the reference's own top k, yet allowed: near-ties the engine's arithmetic took the other
    way)}. `moe`: the reference config's MoE part (n_used, n_group, topk_group)."""
    rows = []
    for il in range(n_layer):
        name, scores = f"ffn_moe_topk-{il}", f"ffn_moe_scores-{il}"
        if name in engine_caps and scores in ref_caps and scores in emu_caps:
            tol = routing_tolerance(ref_caps[scores], emu_caps[scores])
            bad = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, tol, moe.n_group,
                                       moe.topk_group)
            other = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, 0.0, moe.n_group,
                                         moe.topk_group) & ~bad
            rows.append({"layer": il, "disagreement": float(bad.mean()), "tolerance": tol,
                         "positions": [int(p) for p in np.nonzero(bad)[0][:8]], "near_ties_taken": int(other.sum())})
    return rows


def router_inputs_differ(il: int, engine_caps: Mapping[str, Any], ref_caps: Mapping[str, Any],
                         emu_caps: Mapping[str, Any], diverged: set) -> str:
    """Why layer il's router does not see the reference's input ("" when it does): its input itself
    (`ffn_norm-{il}`) beyond the engine's noise when both sides expose it, else a divergent point
    upstream of the router in the layer curve (`diverged`: {(layer, point)})."""
    name = f"ffn_norm-{il}"
    if name in engine_caps and name in ref_caps and name in emu_caps:
        p = PointError(il, "ffn_norm", metrics.rel_l2(engine_caps[name], ref_caps[name]),
                       metrics.rel_l2(emu_caps[name], ref_caps[name]))
        return f"{name} {off_by(p)}" if p.divergent else ""
    before = sorted((layer, pt) for layer, pt in diverged if layer < il or layer == il and pt in BEFORE_ROUTER)
    return f"the engine diverges at {before[0][1]}-{before[0][0]}" if before else ""
