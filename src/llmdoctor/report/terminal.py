"""Human-readable rendering with rich. Knows nothing of how findings were measured."""

from __future__ import annotations

import sys
from typing import Any

from rich.console import Console
from rich.table import Table

stdout = Console(highlight=False, soft_wrap=True)
stderr = Console(stderr=True, highlight=False)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _kv_table(title: str, d: dict[str, Any]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    for k, v in d.items():
        t.add_row(k, "-" if v is None else str(v))
    return t


def render_inspect(s: dict[str, Any], console: Console = stdout) -> None:
    f = s["file"]
    console.print(
        f"[bold]{s['name'] or '(unnamed)'}[/bold]  architecture [bold]{s['architecture']}[/bold]  "
        f"GGUF v{f['version']} ({f['byte_order']}-endian), {human_bytes(f['size'])}, "
        f"alignment {f['alignment']}"
    )
    shards = s.get("shards", [])
    if len(shards) > 1:
        t = Table(title=f"Shards: {len(shards)}, {human_bytes(f['size'])} in all", title_justify="left")
        for col in ("file", "bytes", "tensors"):
            t.add_column(col, justify="left" if col == "file" else "right")
        for sh in shards:
            t.add_row(sh["file"].rsplit("/", 1)[-1], human_bytes(sh["bytes"]), str(sh["tensors"]))
        console.print(t)
    console.print(_kv_table("Hyperparameters", s["hyperparameters"]))
    console.print(_kv_table("Tokenizer", s["tokenizer"]))
    ts = s["tensors"]
    t = Table(title=f"Tensors: {ts['count']}, {ts['parameters']:,} parameters, {human_bytes(ts['bytes'])}",
              title_justify="left")
    t.add_column("type")
    t.add_column("count", justify="right")
    t.add_column("bytes", justify="right")
    for name, row in ts["by_type"].items():
        t.add_row(name, str(row["count"]), human_bytes(row["bytes"]))
    console.print(t)
    if "tensor_table" in s:
        tt = Table(title="Tensor table (shape is row-major; ne is GGUF order)", title_justify="left")
        for col in ("name", "type", "shape", "ne", "offset", "bytes"):
            tt.add_column(col, justify="right" if col in ("offset", "bytes") else "left")
        for r in s["tensor_table"]:
            flag = "" if r["supported"] else " (unsupported: big-endian)"
            tt.add_row(r["name"], r["type"] + flag, str(tuple(r["shape"])), str(tuple(r["ne"])),
                       str(r["offset"]), str(r["nbytes"]))
        console.print(tt)


def findings_table(findings: list[Any], title: str | None = None, console: Console = stdout) -> None:
    """status / target / what, one row per finding (printed only when there is a row)."""
    table = Table("status", "target", "what", title=title, title_justify="left")
    for f in findings:
        table.add_row(f.status, f.target, f.explanation or f.reason)
    if table.row_count:
        console.print(table)


def allowance_table(findings: list[dict[str, Any]], console: Console = stdout) -> None:
    """diagnose: each judged criterion (a finding's evidence rows with a `ratio`, and the layer points' worst or
    first divergent one) against its allowance, how many times it, and whether the verdict is marginal (within
    2x either way: a longer prompt or another dtype settles it). Printed only when there is a row."""
    table = Table("check", "criterion", "verdict", "x allowance", "marginal", title="Confidence",
                  title_justify="left")
    for f in findings:
        rows = [(e["criterion"], "pass" if e["ok"] else "fail", e["ratio"], e.get("marginal"))
                for e in f.get("evidence") or [] if isinstance(e, dict) and "criterion" in e and "ratio" in e]
        m = f.get("metrics") or {}
        if f["check"] == "layer-localization" and f["status"] != "skip":
            ratio = m.get("ratio", m.get("worst_ratio"))
            if ratio is not None:
                rows.append((m.get("point") and f"{m['point']}-{m.get('first_divergent_layer')}" or m.get("worst", "points"),
                             f["status"], ratio, m.get("marginal")))
        for name, verdict, ratio, near in rows:
            table.add_row(f["check"], str(name), verdict, f"{ratio:.3g}" if isinstance(ratio, (int, float)) else str(ratio),
                          "marginal" if near else "")
    if table.row_count:
        console.print(table)


def summary_line(verdict: str, findings: list[Any], seconds: float | None = None, console: Console = stdout) -> None:
    """"<verdict>: N passed, N failed, N skipped[ in S s]"."""
    from ..checks.base import count

    c = count(findings)
    took = "" if seconds is None else f" in {seconds:.1f} s"
    console.print(f"{verdict}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped{took}")


def attention_cases_table(findings: list[Any], k_floor: float, console: Console = stdout) -> None:
    """`check attention`: every case that did not pass, and every pass that carries information (a probe,
    NaN from unused cache rows), with its error against its budget (half precision: K times the noise
    floor; float32: the derived rounding bound's largest element)."""
    table = Table("subject", "case", "status", "max|err|", "budget", "why")
    for f in findings:
        if f.status == "pass" and "information" not in f.reason:
            continue
        fl = f.budget.get("floor_max_abs", f.budget.get("floor"))
        err = f.metrics.get("max_abs_diff")
        bound = f.budget.get("bound_max")
        status = "pass (information)" if f.status == "pass" else f.status
        table.add_row(f.subject, f.target, status, "" if err is None else f"{err:.3g}",
                      f"{k_floor * fl:.3g}" if fl is not None else "" if bound is None else f"<= {bound:.3g}",
                      f.reason if f.status == "pass" else f.explanation or f.reason)
    console.print(table)


def sharding_table(findings: list[Any], console: Console = stdout) -> None:
    """`check sharding`: what did not pass per plan and point, and the first divergence."""
    table = Table("status", "plan", "point", "max |diff| / budget", "what")
    for f in findings:
        if f.status != "pass" or f.target == "first-divergence":
            ratio = f.metrics.get("max_over_budget")
            table.add_row(f.status, f.subject, f.target, "" if ratio is None else f"{ratio:.3g}", f.explanation or f.reason)
    console.print(table)


def render_probe(rep: Any, console: Console = stdout) -> None:
    """`probe`: one row per probe with its symptom and numbers, the thresholds, the verdict."""
    out = console
    out.print(f"[bold]{rep.url}[/bold]  model {rep.model}  ({rep.wall_s:.0f} s, {rep.n_requests} requests)")
    table = Table(show_edge=False)
    for col in ("status", "probe", "symptom", "evidence"):
        table.add_column(col)
    for f in rep.findings:
        m = f.metrics
        if f.status == "skip":
            detail = f.reason
        elif "expected_logprob" in m:
            detail = f"expected logprob {m['expected_logprob']:.3f}, rank {m['expected_rank']}, tail {m['tail_mass']:.3f}"
        elif "kl_max" in m:
            detail = f"KL max {m['kl_max']:.2e}, top-1 agreement {m['top1_agreement']:.2f} over {m['positions']} positions"
        elif "kl" in m and "top1_agree" in m:
            detail = f"KL {m['kl']:.2e}, top-1 {'same' if m['top1_agree'] else 'differs'}"
        elif "max_abs_dlogprob" in m:
            detail = f"max |dlogprob| {m['max_abs_dlogprob']:.2e}, same text {m['same_text']}"
        else:
            detail = f.explanation or ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                                for k, v in m.items() if k != "symptom" and not isinstance(v, list))
        if f.status == "fail" and f.explanation and detail != f.explanation:
            detail = f"{f.explanation} ({detail})"
        table.add_row(f.status, f.target, m.get("symptom", ""), detail)
    out.print(table)
    out.print("thresholds: " + "; ".join(f"{k} {v['value']:.3g}" for k, v in rep.thresholds.items()))
    symptoms = ", ".join(rep.symptoms) or "none"
    out.print(f"[bold]verdict: {rep.verdict}[/bold]  symptoms: {symptoms}")


def error_line(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def render_dequant(kernel: str, by_type: dict[str, dict[str, Any]], findings: list[Any], verdict: str,
                   console: Console = stdout) -> None:
    """`check dequant`: a per-type table, then every failed or skipped tensor with its reason."""
    t = Table(title=f"Kernel {kernel!r} against the reference (gguf-py)", title_justify="left")
    for col in ("type", "tensors", "pass", "fail", "skip", "compared", "mismatch", "max |diff|", "rel L2"):
        t.add_column(col, justify="left" if col == "type" else "right")
    for name, s in by_type.items():
        t.add_row(name, str(s["tensors"]), str(s["passed"]), str(s["failed"]), str(s["skipped"]),
                  f"{s['compared_elements']:,}", f"{s['mismatches']:,}", f"{s['max_abs_diff']:.3g}",
                  f"{s['rel_l2']:.3g}")
    console.print(t)
    reduced = [f for f in findings if f.status == "pass" and f.reason == "reduced-precision arithmetic"]
    if reduced:
        console.print(f"{len(reduced)} tensor(s) pass as reduced-precision arithmetic "
                      f"({reduced[0].budget.get('precision')}): within the derived rounding bound")
    for f in reduced:  # a pass, yet no deployment computing in that precision gets these weights
        if f.metrics.get("overflow_elements"):
            console.print(f"[yellow]note[/yellow] {f.target}: {f.explanation.split('; ', 1)[-1]}")
    for f in findings:
        if f.status == "fail":
            console.print(f"[red]FAIL[/red] {f.target}: {f.reason}")
            wb = f.metrics.get("worst_block")
            if wb:
                console.print(f"     worst block {wb['index']} at file offset {wb['file_offset']}: "
                              f"element {tuple(wb['element'])} got {wb['got']!r}, want {wb['want']!r}")
            for e in f.evidence[:4]:
                console.print(f"     element {tuple(e['element'])}: got {e['got']!r}, want {e['want']!r}")
        elif f.status == "skip":
            console.print(f"[yellow]skipped[/yellow] {f.target}: {f.reason}")
    style = {"passed": "green", "failed": "red"}.get(verdict, "yellow")
    console.print(f"[{style}]{verdict}[/{style}]")
