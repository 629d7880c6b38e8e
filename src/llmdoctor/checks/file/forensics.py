"""Weight forensics: what a lone GGUF file betrays about its own weights.

Per tensor, from its quantized blocks and its dequantized values (the statistics `verify` gathers in
its one streaming pass), then each tensor against its role siblings (blk.N.attn_output against every
other blk.M.attn_output). With no second copy of the model the only yardstick is the model itself:
the layers of one network were trained alike and quantized alike, so a tensor whose statistics stand
far outside its siblings' spread was changed after the fact.

The parts: tensor_stats.py gathers one tensor's statistics in one streaming pass (verify feeds its
Accumulator per chunk) from block_scales.py, subblock_codes.py and weight_moments.py (their C passes:
forensics_native.py); sibling_outliers.py compares each tensor with its siblings. Here:

    findings = compare(all_stats, file=path)    # absolute rules, sub-block rules, sibling outliers

and `analyze(path)`, all of it for a file (diagnose's file-integrity step and the tests).

What the statistics can see (tests/checks/file/test_forensics.py plants each): non-finite scales or weights
(absolute rule); block scales multiplied by noise (signs, the spread of |scale| in binades); a Q4_K tensor
whose d and dmin were exchanged (dmin/d ratio, mean/RMS, RMS). Inside K-quant blocks, the sub-block
scale and min codes are held to where llama.cpp's quantizer always puts the block's extreme sub-block
(subblock_codes.py; tests/checks/file/test_forensics_subblocks.py plants changed code bytes).
What they cannot see: two layers' tensors exchanged, or one tensor's rows permuted; every statistic
here is invariant under both (a tensor's statistics move with it; a permutation of rows keeps every
value). Those need a second copy: `diff`, `--manifest`, or `--hf`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as QT

from ..base import Finding
from .sibling_outliers import MIN_SIBLINGS, outliers
from .subblock_codes import SUBBLOCKS
from .tensor_stats import TensorStats, tensor_stats

CHECK = "forensics"
IMATRIX_KEYS = "quantize.imatrix."  # llama-quantize records the importance matrix it used under these keys


def _imatrix_recorded(file: str | Path) -> bool:
    """Whether the file's metadata says an importance matrix was used (False where there is no file)."""
    if not file or not Path(file).is_file():
        return False
    from ...gguf import open_gguf

    with open_gguf(file) as g:
        return any(k.startswith(IMATRIX_KEYS) for k in g.fields)


def subblock_rules(stats: list[TensorStats], file: str | Path = "") -> dict[str, Any]:
    """Decide, for the code families pinned only without an importance matrix (Q2_K, Q4_K, Q5_K), whether
    the exact rule holds in this file, and write each family's rule ("exact" or "siblings") into its
    tensor's summary. Not exact when the metadata records an importance matrix, or when the file bears
    its mark without the record (the library call llama_model_quantize writes none): more than half of
    at least MIN_SIBLINGS such tensors with blocks off the end. Damage that reaches most tensors of a
    file is then compared among siblings instead; corruption of a few tensors leaves the majority exact."""
    partial = [st for st in stats if st.subblocks and not all(
        f.every_path for f in SUBBLOCKS[QT[st.qtype]].families)]
    off = sum(any(st.subblocks[f.name]["off_blocks"] for f in SUBBLOCKS[QT[st.qtype]].families) for st in partial)
    # the metadata is read only when it matters (some block off the end): a clean file is not reopened
    recorded = _imatrix_recorded(file) if off else None
    marked = len(partial) >= MIN_SIBLINGS and off > len(partial) / 2
    exact = not (recorded or marked)
    for st in stats:
        for f in SUBBLOCKS[QT[st.qtype]].families if st.subblocks else ():
            st.subblocks[f.name]["rule"] = "exact" if f.every_path or exact else "siblings"
    return {"tensors": sum(1 for st in stats if st.subblocks), "partial_rule_exact": exact,
            "imatrix_recorded": recorded, "partial_tensors_off": off, "partial_tensors": len(partial)}


def _subblock_finding(st: TensorStats, file: str | Path) -> Finding | None:
    """A fail finding for a tensor whose blocks break an exact sub-block rule, else None."""
    sb = st.subblocks
    bad = [(n, v) for n, v in sb.items() if isinstance(v, dict) and v.get("rule") == "exact" and v["off_blocks"]]
    if not bad:
        return None
    words = []
    for name, v in bad:
        end = " or ".join(str(c) for c in v["pinned"])
        words.append(f"{v['off_blocks']} of {sb['blocks']} {st.qtype} blocks have their {v['reduce']} sub-block "
                     f"{name[:-1]} code off {end} (first: block {v['first_off_block']}, {v['reduce']} "
                     f"{v['first_off_code']})")
    return Finding(CHECK, "gguf", st.name, "fail", id=f"{CHECK}/subblocks/{st.name}",
                   hypothesis=SUBBLOCK_HYPOTHESIS, confidence="high",
                   metrics={"subblocks": sb, "off_blocks": sum(v["off_blocks"] for _, v in bad)},
                   budget={"off_blocks_max": 0},
                   explanation=f"{st.name}: " + "; ".join(words) + ": llama.cpp's quantizer puts the block's "
                               "extreme sub-block there in every block it writes, so sub-block scale bytes "
                               "were changed after quantization",
                   evidence=[{"tensor": st.name, "file": str(file), "family": n, **{k: v[k] for k in (
                       "first_off_block", "first_off_code", "extreme_codes")}} for n, v in bad])


def _subblock_words(rules: dict[str, Any]) -> str:
    if not rules["tensors"]:
        return ""
    how = "" if rules["partial_rule_exact"] else \
        " (Q2_K/Q4_K/Q5_K compared among siblings: " + ("the metadata records an importance matrix)"
                                                        if rules["imatrix_recorded"] else
                                                        "most of their tensors bear an importance matrix's mark)")
    return f"{rules['tensors']} K-quant tensors' sub-block codes end where llama.cpp's quantizer puts them{how}; "


SUBBLOCK_HYPOTHESIS = "every K-quant block's sub-block codes end where llama.cpp's quantizer puts them"


def compare(stats: list[TensorStats], *, file: str | Path = "") -> list[Finding]:
    """The findings: one per tensor with non-finite scales or weights, one per tensor whose K-quant
    sub-block codes break an exact rule, one per sibling outlier tensor (its worst metrics side by
    side with its siblings'), then one pass or skip summary."""
    out: list[Finding] = []
    rules = subblock_rules(stats, file)
    for st in stats:
        bad_scales = {f: s["nonfinite"] for f, s in st.scales.items() if s["nonfinite"]}
        if st.nonfinite or bad_scales:
            what = [f"{round(v * st.scales[f]['blocks'])} non-finite block scale(s) {f}" for f, v in bad_scales.items()]
            if st.nonfinite:
                what.append(f"{st.nonfinite} non-finite weights (first in block {st.first_nonfinite_block})")
            out.append(Finding(CHECK, "gguf", st.name, "fail", metrics=st.as_dict(), hypothesis=HYPOTHESIS,
                               explanation=f"{st.name}: " + ", ".join(what) + ": the tensor is corrupted",
                               evidence=[{"tensor": st.name, "file": str(file)}]))
    out += [f for f in (_subblock_finding(st, file) for st in stats) if f is not None]
    found, summary = outliers(stats)
    summary["subblocks"] = rules
    by_tensor: dict[str, list[dict]] = defaultdict(list)
    for o in found:
        by_tensor[o["tensor"]].append(o)
    for name, rows in by_tensor.items():
        rows.sort(key=lambda o: -o["robust_z"])
        out.append(Finding(CHECK, "gguf", name, "fail", hypothesis=HYPOTHESIS,
                           metrics={"outliers": rows, "worst_metric": rows[0]["metric"], "robust_z": rows[0]["robust_z"]},
                           budget={"robust_z_max": summary["limit"]},
                           explanation="; ".join(o["words"] for o in rows[:2]) +
                                       ": it stands out from its role siblings (changed after quantization?)",
                           evidence=rows))
    if not out:
        n = summary["roles_compared"]
        if n == 0:
            out.append(Finding(CHECK, "gguf", "siblings", "skip", hypothesis=HYPOTHESIS,
                               reason=f"no tensor role has {MIN_SIBLINGS} or more layers to compare "
                                      f"(only the absolute rules ran: {len(stats)} tensors finite; "
                                      f"{_subblock_words(rules).rstrip('; ') or 'no K-quant tensor'})",
                               metrics=summary))
        else:
            out.append(Finding(CHECK, "gguf", "siblings", "pass", hypothesis=HYPOTHESIS, metrics=summary,
                               budget={"robust_z_max": summary["limit"]},
                               explanation=f"no tensor stands out from its role siblings: {len(stats)} tensors finite; "
                                           f"{_subblock_words(rules)}"
                                           f"{summary['tests']} statistics in {n} roles within "
                                           f"{summary['limit']:.1f} robust spreads of their siblings"))
    return out


HYPOTHESIS = "every tensor's block scales and weights look like its role siblings'"


def analyze(path: str | Path, weights: Any = None) -> tuple[list[Finding], list[TensorStats]]:
    """Every tensor of the file: statistics and findings. `weights`: an optional cache with
    has(name) / get(name) of already dequantized tensors (the reference's), reused."""
    from ...gguf import open_gguf

    with open_gguf(path) as g:
        stats = [tensor_stats(t, weights.get(t.name) if weights is not None and weights.has(t.name) else None)
                 for t in g.tensors if t.supported]
    return compare(stats, file=path), stats

