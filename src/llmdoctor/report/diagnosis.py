"""Terminal rendering of a diagnosis: the verdict first, then the ranked suspects, then what was
ruled out and what could not run (with why)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table


def _metrics_line(m: dict[str, Any], n: int = 4) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return ", ".join(f"{k}={fmt(v)}" for k, v in list(m.items())[:n])


def group_by_check(findings: list[dict[str, Any]]) -> list[tuple[dict[str, Any], int]]:
    """One row per check, in rank order: (its first finding, how many more of the same check)."""
    out: list[tuple[dict[str, Any], int]] = []
    index: dict[str, int] = {}
    for f in findings:
        if f["check"] in index:
            first, more = out[index[f["check"]]]
            out[index[f["check"]]] = (first, more + 1)
        else:
            index[f["check"]] = len(out)
            out.append((f, 0))
    return out


def render(doc: dict[str, Any], console: Console) -> None:
    code = doc["exit_code"]
    style = {0: "bold green", 1: "bold red"}.get(code, "bold yellow")
    console.print(f"[{style}]{doc['verdict']}[/{style}]")
    c = doc["counts"]
    console.print(f"{c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped")
    by_id = {f["id"]: f for f in doc["findings"]}
    suspects = group_by_check([by_id[i] for i in doc.get("suspects", []) if i in by_id])
    if suspects:
        t = Table(title="Suspects, most likely first", title_justify="left")
        for col in ("#", "check", "target", "evidence", "confidence"):
            t.add_column(col)
        for i, (f, more) in enumerate(suspects, 1):
            target = f["target"] + (f" (+{more} more)" if more else "")
            t.add_row(str(i), f["check"], target, f["explanation"] or f["reason"], f.get("confidence", ""))
        console.print(t)
    ruled = [f for f in doc["findings"] if f["status"] == "pass"]
    if ruled:
        t = Table(title="Ruled out", title_justify="left")
        for col in ("check", "evidence", "metrics"):
            t.add_column(col)
        for f in ruled:
            t.add_row(f["check"], f["explanation"], _metrics_line(f.get("metrics", {})))
        console.print(t)
    skipped = [f for f in doc["findings"] if f["status"] == "skip"]
    if skipped:
        t = Table(title="Skipped", title_justify="left")
        t.add_column("check")
        t.add_column("why")
        for f in skipped:
            t.add_row(f["check"], f"skipped: {f['reason']}")
        console.print(t)
    from .terminal import allowance_table

    allowance_table(doc["findings"], console)  # how far each criterion is from its allowance, marginal ones flagged
    _engine_config((doc.get("engine_run") or {}).get("engine_config"), console)


def _engine_config(config: dict[str, Any] | None, console: Console) -> None:
    """The deployment's engine configuration as the engine resolved its --engine-args, beside its defaults
    for the same model (subjects/engines/vllm_driver.py `engine_config`); nothing without --engine-args."""
    if not config:
        return
    t = Table(title="Engine configuration (--engine-args), as the engine resolved it", title_justify="left")
    for col in ("setting", "deployed", "engine default"):
        t.add_column(col)
    for key, value in config["resolved"].items():
        default = config["defaults"].get(key)
        differs = key in config["differs"]
        t.add_row(key, f"[bold]{value}[/bold]" if differs else str(value), str(default) if differs else "")
    console.print(t)
    if config.get("llmdoctor_sets"):
        console.print("set by llmdoctor (not the arithmetic): " + _metrics_line(config["llmdoctor_sets"], 10))
    env = (config.get("env") or {}).get("read") or {}
    if env:
        console.print("engine environment: " + _metrics_line(env, len(env)))
