"""Discrete choices an engine makes inside the model, judged against the reference's scores: the keys a
DSA indexer selects per query (GLM-5's glm-dsa) and the experts a MoE router picks per token. Neither
choice is unique where scores tie or nearly tie, so each is judged by whether the scores *allow* it,
within what the engine's own arithmetic (the emulated run's) moves a score."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from .. import metrics
from .allowance import poisson_allowance
from .layers import PointError, off_by

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


def routing_tolerance(ref_scores: Any, emu_scores: Any, k: int, level: float, n_group: int = 1,
                      topk_group: int = 1) -> np.ndarray:
    """float [T]: how far below an unchosen expert a chosen one may score and still be a healthy engine's choice
    at position t: z x swap_scale's s_t (the emulated run's error on the same routing scores), z set so that
    any of the layer's comparisons (k chosen x E - k unchosen experts per position, and topk_group x the other
    groups where routing is grouped) moves that far with probability at most `level` (Bonferroni).
    ref_scores, emu_scores: float [T, E]."""
    ref, emu = np.asarray(ref_scores, dtype=np.float64), np.asarray(emu_scores, dtype=np.float64)
    t_n, e_n = ref.shape
    g_n = n_group if n_group > 1 and e_n % n_group == 0 else 1
    comparisons = max(t_n * (k * (e_n - k) + topk_group * (g_n - topk_group) * (g_n > 1)), 1)
    return _normal_isf(level / comparisons) * swap_scale(ref, emu, np.isfinite(ref))


def routing_inadmissible(scores: Any, chosen: Any, k: int, tol: Any, n_group: int = 1,
                         topk_group: int = 1) -> Any:
    """bool [T]: positions whose chosen experts are no top-k choice the reference's selection scores
    allow within `tol` (routing_tolerance: one per position [T], or one for all). Ungrouped: every chosen
    expert scores at least the best unchosen one minus tol. Grouped (DeepSeek-V3's n_group / topk_group):
    the chosen experts' groups, filled up with the best other groups, are a top-topk_group set of group
    scores within 2 tol (a group score sums two experts', reference/arch_deepseek.group_scores), and the
    experts are a top-k set within those groups. Duplicates, out-of-range ids and a wrong count are inadmissible.
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
    tols = np.broadcast_to(np.asarray(tol, dtype=np.float64), (t_n,))
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
            if len(mine) > topk_group or (out and gs[t, keep].min() < gs[t, out].max() - 2 * tols[t]):
                bad[t] = True
                continue
            pool = np.concatenate([np.arange(g * per, (g + 1) * per) for g in keep])
        unchosen = [j for j in pool if j not in picks]
        bad[t] = bool(unchosen) and sc[t, sorted(picks)].min() < sc[t, unchosen].max() - tols[t]
    return bad


def excess_misses(engine_bad: Any, emu_bad: Any, level: float) -> dict[str, Any]:
    """The engine's misses over a group of queries judged against the emulated run's on the same queries
    (McNemar's exact test): a healthy engine and the emulated run are two draws of the same arithmetic, so
    each query's pair (engine misses, emulated misses) is exchangeable, and of the d discordant queries
    (one side misses) the engine's count is Binomial(d, 1/2) whatever each query's own chance of a flip.
    The engine may miss alone in at most `allowed` of them (the tail beyond it at most `level`).
    engine_bad, emu_bad: bool [n]. Returns {"disagreement", "noise", "limit" (the rate of both + allowed),
    "queries", "alone" (the engine's misses where the emulated run keeps a top-k set), "discordant",
    "allowed", "level"}."""
    eng, emu = np.asarray(engine_bad, dtype=bool), np.asarray(emu_bad, dtype=bool)
    n = int(eng.size)
    both, alone = int((eng & emu).sum()), int((eng & ~emu).sum())
    d = alone + int((emu & ~eng).sum())
    allowed, tail = d, 0.0  # the smallest a with P(Bin(d, 1/2) > a) <= level
    for a in range(d, -1, -1):
        if tail + math.comb(d, a) * 0.5**d > level:
            break
        tail += math.comb(d, a) * 0.5**d
        allowed = a - 1
    rate = (lambda c: c / n) if n else (lambda c: 0.0)
    return {"disagreement": rate(both + alone), "noise": rate(int(emu.sum())), "limit": rate(both + allowed),
            "queries": n, "alone": alone, "discordant": d, "allowed": allowed, "level": level}


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


def swap_scale(scores: np.ndarray, emu_scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """float [T]: the scale s_t by which a healthy engine's arithmetic moves the difference of two of row t's
    scores: sqrt(2) x the emulated run's RMS score error over the row's visible scores (sigma_t), widened by
    the emulated run's own tail (its largest |e| / sigma_t over every score against the Gaussian expectation
    for that many: never narrowed), plus a few float32 roundings of the row's largest score. A difference
    moves by more than z s_t with probability at most P(N(0, 1) > z). scores, emu_scores: float [T, S]
    (the reference's and the emulated run's); visible: bool [T, S]."""
    err = np.subtract(emu_scores, scores, out=np.zeros_like(scores), where=visible & np.isfinite(emu_scores))
    n_vis = np.maximum(visible.sum(axis=1), 1)  # [T]
    sigma = np.sqrt((err * err).sum(axis=1) / n_vis)  # [T]
    z = np.where(sigma[:, None] > 0, np.abs(err) / np.where(sigma > 0, sigma, 1.0)[:, None], 0.0)
    tail = max(1.0, float(z.max(initial=0.0)) / _normal_isf(0.5 / max(int(visible.sum()), 1)))
    floor = 8 * 2.0**-24 * np.max(np.where(visible, np.abs(scores), 0.0), axis=1, initial=0.0)  # [T]
    return tail * math.sqrt(2.0) * sigma + floor


def wrong_picks(scores: Any, selected: Any, emu_scores: Any, top_k: int) -> dict[str, Any]:
    """The per-key statistic of a DSA layer over its queries that choose (they see more than top_k keys): a
    pick is *wrong* when its reference score falls below the k-th best by more than the engine's score error
    could move it (or it is no valid, visible, distinct key). A pick of key j over the k-th key i needs
    e_j - e_i >= gap, whose scale is swap_scale's s_t (the engine's arithmetic, FP8 indexer included, on the
    same scores, as the emulated run does it). A pick is wrong beyond s_t. A healthy engine still makes a
    wrong pick of a key j with probability at most P(N(0, 1) > gap_j / s_t), so the expected healthy count
    is at most lam = the sum of that over every visible key below the k-th by more than s_t (queries x keys,
    from the reference's own scores): the allowance is Poisson(lam)'s count exceeded with probability
    `level` (set by dsa_rows for the whole diagnosis). Where the FP8 indexer makes exact top-k sets rare,
    picks far below the k-th still stand out.
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
    scale = swap_scale(sc, em, visible)  # [Tc]
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
             engine_caps: Mapping[str, Any], level: float) -> list[dict]:
    """Per indexer layer, the engine's picks judged in two groups of queries: those that see more keys than
    they keep (excess_misses' keys: where the indexer chooses, against the emulated run's own top k on the
    same queries) and those that see at most top_k keys and must keep them all ("short": their selection is
    determined, which no rounding changes, so its limit is the emulated run's misses: none); and per key
    (wrong_picks). Pooled with the short rows, which a healthy engine never misses, the choosing rows' rate
    would be diluted below any limit (on the H200's GLM-5 prompt, 128 of 200 rows are short). `level`: each
    layer's two statistical tests' false-alarm chance (the diagnosis's share per item). A shared layer uses
    the last full layer's scores. llama.cpp's view of the selection that layer il's attention reads is
    "top_k-{il} (view)" (its own indexer's or the shared one's); the bare "top_k-{il}" node is not reliably
    that layer's."""
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
            short = ~choosing
            n_short, short_noise = int(short.sum()), float(emu_bad[short].mean()) if short.any() else 0.0
            keys = wrong_picks(scores, engine_sel, emu_scores, top_k)
            keys["level"] = level
            keys["allowance"] = poisson_allowance(keys["expected"], level)
            rows.append({"layer": il, **excess_misses(engine_bad[choosing], emu_bad[choosing], level),
                         "short": {"disagreement": float(engine_bad[short].mean()) if n_short else 0.0,
                                   "noise": short_noise, "limit": short_noise, "queries": n_short},
                         "keys": keys})
    return rows


def dsa_misses(row: dict) -> str:
    """Why a dsa_rows row fails ("" when it passes): the queries that choose missing the reference's top k
    where the emulated run does not (excess_misses), a short query's selection missed, or the picks far below
    the k-th score beyond their allowance (wrong_picks)."""
    if row["disagreement"] > row["limit"]:
        return (f"{row['disagreement']:.0%} of the {row['queries']} queries that choose keep no top-k set of the "
                f"reference's scores ({row['noise']:.0%} under the engine's emulated arithmetic): {row['alone']} "
                f"where the emulated run keeps one, where a healthy engine misses alone in at most {row['allowed']} of the "
                f"{row['discordant']} queries either misses (false-alarm chance {row['level']:.2g})")
    short = row["short"]
    if short["disagreement"] > short["limit"]:
        return (f"{short['disagreement']:.0%} of the {short['queries']} queries that see at most top-k keys drop a "
                "key they see (their selection is determined: no rounding explains a miss)")
    keys = row.get("keys")
    if keys and keys["wrong"] > keys["allowance"]:
        return (f"{keys['wrong']} of {keys['picks']} picks of the {keys['queries']} queries that choose score below "
                f"the k-th best by more than the engine's score error ({keys['scale']:.3g}), where a healthy "
                f"engine makes at most {keys['allowance']} (false-alarm chance {keys['level']:.2g})")
    return ""


def moe_rows(n_layer: int, moe: Any, ref_caps: Mapping[str, Any], emu_caps: Mapping[str, Any],
             engine_caps: Mapping[str, Any], level: float) -> list[dict]:
    """Per MoE layer the engine exposes: {"layer", "disagreement" (positions whose experts the scores do
    not allow within routing_tolerance at `level`, each layer's false-alarm chance), "tolerance" (the largest
    position's), "positions" (the first 8 of those), "near_ties_taken" (experts not the reference's own top k,
    yet allowed: near-ties the engine's arithmetic took the other way)}. `moe`: the reference config's MoE
    part (n_used, n_group, topk_group)."""
    rows = []
    for il in range(n_layer):
        name, scores = f"ffn_moe_topk-{il}", f"ffn_moe_scores-{il}"
        if name in engine_caps and scores in ref_caps and scores in emu_caps:
            tol = routing_tolerance(ref_caps[scores], emu_caps[scores], moe.n_used, level, moe.n_group,
                                    moe.topk_group)
            bad = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, tol, moe.n_group,
                                       moe.topk_group)
            other = routing_inadmissible(ref_caps[scores], engine_caps[name], moe.n_used, 0.0, moe.n_group,
                                         moe.topk_group) & ~bad
            rows.append({"layer": il, "disagreement": float(bad.mean()), "tolerance": float(tol.max(initial=0.0)),
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
