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


def error_line(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
