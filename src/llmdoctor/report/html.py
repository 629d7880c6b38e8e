"""A self-contained HTML report (no scripts, no external assets): the verdict, the ranked suspects,
what was ruled out and skipped, and inline SVG plots — the per-layer error curve against its noise
budget, per-type dequant error, and probe logprob bars when those findings exist.
"""

from __future__ import annotations

import html
import math
from typing import Any

_CSS = """
body{font:15px/1.45 system-ui,sans-serif;margin:2rem auto;max-width:62rem;color:#1b1f24;padding:0 1rem}
h1{font-size:1.5rem;margin:0 0 .3rem} h2{font-size:1.1rem;margin:1.6rem 0 .5rem;border-bottom:1px solid #ddd}
.verdict{padding:.8rem 1rem;border-radius:6px;font-weight:600;margin:.8rem 0}
.ok{background:#e6f4ea;color:#0d5c2e} .bad{background:#fdecea;color:#8a1c12} .unk{background:#fff4e0;color:#7a4b00}
table{border-collapse:collapse;width:100%;font-size:.9rem} td,th{border-bottom:1px solid #eee;padding:.3rem .4rem;
text-align:left;vertical-align:top} th{color:#555;font-weight:600}
.pass{color:#0d5c2e} .fail{color:#8a1c12;font-weight:600} .skip{color:#7a4b00}
code{background:#f4f4f4;padding:0 .2rem;border-radius:3px} .small{color:#666;font-size:.85rem}
svg text{font:11px system-ui,sans-serif;fill:#333}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return _e(v)


def _metrics_note(f: dict) -> str:
    shown = list((f.get("metrics") or {}).items())[:6]
    return "<br><span class=small>" + ", ".join(f"{_e(k)}={_fmt(v)}" for k, v in shown) + "</span>" if shown else ""


def _findings_table(fs: list[dict]) -> str:
    rows = "".join(
        f"<tr><td class='{f['status']}'>{_e(f['status'])}</td><td><code>{_e(f['check'])}</code></td>"
        f"<td>{_e(f['subject'])}</td><td>{_e(f['target'])}</td>"
        f"<td>{_e(f.get('explanation') or f.get('reason') or '')}{_metrics_note(f)}</td></tr>"
        for f in fs)
    return f"<table><tr><th></th><th>check</th><th>subject</th><th>target</th><th>evidence</th></tr>{rows}</table>"


def _log_y(v: float, lo: float, hi: float, top: float, height: float) -> float:
    v = min(max(v, lo), hi)
    return top + height * (1 - (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo)))


def layer_curve_svg(curve: list[dict], width: int = 900, height: int = 300) -> str:
    """Per-layer rel. L2 error of the engine (dots, red when divergent) and its limit (line), log scale."""
    pts = [p for p in curve if p.get("point") == "l_out"] or curve
    if not pts:
        return ""
    vals = [v for p in pts for v in (p["error"], p["limit"]) if isinstance(v, (int, float)) and v > 0 and math.isfinite(v)]
    lo = 10 ** math.floor(math.log10(min(vals))) if vals else 1e-6
    hi = 10 ** math.ceil(math.log10(max(vals) * 1.01)) if vals else 1.0
    if hi <= lo:
        hi = lo * 10
    left, top, w, h = 60, 15, width - 80, height - 50
    n = max(p["layer"] for p in pts) + 1
    x = lambda il: left + (il + 0.5) * w / n  # noqa: E731
    out = [f"<svg width='{width}' height='{height}' role='img' aria-label='layer error curve'>"]
    d = 1
    while lo * d <= hi:
        y = _log_y(lo * d, lo, hi, top, h)
        out.append(f"<line x1='{left}' x2='{left + w}' y1='{y:.1f}' y2='{y:.1f}' stroke='#eee'/>"
                   f"<text x='4' y='{y + 4:.1f}'>{lo * d:.0e}</text>")
        d *= 10
    lim = " ".join(f"{x(p['layer']):.1f},{_log_y(p['limit'], lo, hi, top, h):.1f}" for p in pts
                   if isinstance(p["limit"], (int, float)) and math.isfinite(p["limit"]) and p["limit"] > 0)
    out.append(f"<polyline points='{lim}' fill='none' stroke='#888' stroke-dasharray='4 3'/>")
    for p in pts:
        err = p["error"]
        bad = p["divergent"]
        y = _log_y(err if isinstance(err, (int, float)) and math.isfinite(err) and err > 0 else hi, lo, hi, top, h)
        out.append(f"<circle cx='{x(p['layer']):.1f}' cy='{y:.1f}' r='4' fill='{'#c62828' if bad else '#2e7d32'}'>"
                   f"<title>layer {p['layer']} {p['point']}: error {err} limit {p['limit']}</title></circle>")
    for il in range(n):
        out.append(f"<text x='{x(il) - 4:.1f}' y='{top + h + 16}'>{il}</text>")
    out.append(f"<text x='{left + w / 2 - 20}' y='{height - 4}'>layer</text></svg>")
    return "".join(out)


def bars_svg(items: list[tuple[str, float]], *, label: str, log: bool = True, width: int = 900) -> str:
    """Horizontal bars (log scale when `log`), one per (name, value)."""
    items = [(n, v) for n, v in items if isinstance(v, (int, float)) and math.isfinite(v)]
    if not items:
        return ""
    row = 22
    height = row * len(items) + 30
    left, w = 220, width - 260
    vals = [abs(v) for _, v in items if v]
    if log and vals:
        lo, hi = min(vals) / 2, max(vals) * 2
        scale = lambda v: 0 if not v else w * (math.log10(abs(v)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))  # noqa: E731
    else:
        hi = max((abs(v) for _, v in items), default=1) or 1
        scale = lambda v: w * abs(v) / hi  # noqa: E731
    out = [f"<svg width='{width}' height='{height}' role='img' aria-label='{_e(label)}'>"]
    for i, (name, v) in enumerate(items):
        y = 10 + i * row
        out.append(f"<text x='4' y='{y + 14}'>{_e(name)}</text>"
                   f"<rect x='{left}' y='{y + 3}' width='{max(scale(v), 1):.1f}' height='14' fill='#5c7cfa'/>"
                   f"<text x='{left + max(scale(v), 1) + 6:.1f}' y='{y + 14}'>{v:.3g}</text>")
    out.append(f"<text x='{left}' y='{height - 4}'>{_e(label)}</text></svg>")
    return "".join(out)


def render(doc: dict[str, Any]) -> str:
    """The page for a `llmdoctor.diagnose/1` envelope."""
    fs = doc["findings"]
    code = doc["exit_code"]
    cls = {0: "ok", 1: "bad"}.get(code, "unk")
    by_id = {f["id"]: f for f in fs}
    suspects = [by_id[i] for i in doc.get("suspects", []) if i in by_id]
    ruled = [f for f in fs if f["status"] == "pass"]
    skipped = [f for f in fs if f["status"] == "skip"]
    env = doc.get("env", {})
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        "<title>llmdoctor diagnosis</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>llmdoctor diagnosis</h1>",
        f"<div class='small'>{_e(' '.join(doc.get('argv', [])) or '(defaults)')} · llmdoctor {_e(doc.get('version'))}"
        f" · file sha256 {_e((env.get('file') or {}).get('sha256', '-'))}</div>",
        f"<div class='verdict {cls}'>{_e(doc['verdict'])}</div>",
        f"<div class='small'>{doc['counts']['passed']} passed · {doc['counts']['failed']} failed · "
        f"{doc['counts']['skipped']} skipped</div>",
    ]
    if suspects:
        from .diagnosis import group_by_check

        firsts = []
        for f, more in group_by_check(suspects):
            firsts.append({**f, "target": f["target"] + (f" (+{more} more)" if more else "")})
        parts += ["<h2>Suspects, most likely first</h2>", _findings_table(firsts)]
        if len(firsts) < len(suspects):
            parts += [f"<details><summary>all {len(suspects)} failed findings</summary>",
                      _findings_table(suspects), "</details>"]
    curve = doc.get("layer_curve") or []
    if curve:
        parts += ["<h2>Per-layer error vs the engine's noise budget</h2>",
                  "<p class='small'>Dots: relative L2 error of the engine's layer output against the float32 "
                  "reference (red: divergent). Dashed: the limit, K x the error of the reference run with the "
                  "engine's arithmetic emulated.</p>", layer_curve_svg(curve)]
    by_type: dict[str, float] = {}
    for f in fs:
        m = f.get("metrics") or {}
        if f["check"] == "dequant" and f["status"] == "fail" and "type" in m and "rel_l2" in m:
            by_type[m["type"]] = max(by_type.get(m["type"], 0.0), m["rel_l2"])
    if by_type:
        parts += ["<h2>Dequant error by type (worst tensor)</h2>",
                  bars_svg(sorted(by_type.items()), label="relative L2 error vs the reference")]
    probes = [(f["target"], f["metrics"]["expected_logprob"]) for f in fs
              if isinstance(f.get("metrics"), dict) and isinstance(f["metrics"].get("expected_logprob"), (int, float))]
    if probes:
        parts += ["<h2>Probe logprobs of the expected continuation</h2>",
                  bars_svg(probes, label="logprob (0 is certain)", log=False)]
    parts += ["<h2>Ruled out</h2>", _findings_table(ruled) if ruled else "<p>nothing</p>",
              "<h2>Skipped</h2>", _findings_table(skipped) if skipped else "<p>nothing</p>",
              "<h2>Provenance</h2><table>"]
    for k in ("python", "torch", "gguf", "gpu", "compute_capability", "seed"):
        parts.append(f"<tr><th>{_e(k)}</th><td>{_e(env.get(k))}</td></tr>")
    parts.append(f"<tr><th>engines</th><td>{_e(env.get('engines'))}</td></tr></table></body></html>")
    return "".join(parts)
