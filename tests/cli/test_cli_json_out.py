"""Every command that prints JSON (`--json`) also writes it (`--json-out PATH`, atomically): walked
over the whole CLI, so a command added later without it fails here."""

from __future__ import annotations

import json
from pathlib import Path

from typing import Any

import typer
from typer.testing import CliRunner

from llmdoctor.cli import app


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], Any]]:
    """(path, command) of every leaf command (typer's own click: groups are told by `commands`)."""
    if hasattr(cmd, "commands"):
        return [c for name, sub in cmd.commands.items() for c in _commands(sub, (*path, name))]
    return [(path, cmd)]


def _json_commands() -> list[tuple[tuple[str, ...], Any]]:
    found = [(p, c) for p, c in _commands(typer.main.get_command(app))
             if any("--json" in prm.opts for prm in c.params)]
    assert len(found) >= 7, found  # inspect, logits, probe, diagnose, check dequant / mapping / attention
    return found


def _required(cmd: Any) -> list[str]:
    """Placeholder values for the required arguments and options (the run stops before using them)."""
    out: list[str] = []
    for prm in cmd.params:
        if prm.required:
            out += ["x"] if prm.param_type_name == "argument" else [prm.opts[0], "x"]
    return out


def test_every_json_command_takes_json_out_and_checks_the_folder_first(tmp_path: Path) -> None:
    """--json-out is accepted by each command and its folder is checked before any work: an
    unwritable one is a one-line error, exit 2."""
    target = tmp_path / "no-such-folder" / "report.json"
    for path, cmd in _json_commands():
        assert any("--json-out" in prm.opts for prm in cmd.params), f"{' '.join(path)} has --json but no --json-out"
        r = CliRunner().invoke(app, [*path, *_required(cmd), "--json-out", str(target)])
        assert r.exit_code == 2 and "cannot write the report" in r.stderr, (path, r.output)
        assert not target.exists()


def test_json_out_writes_the_envelope_and_keeps_the_human_output(tmp_path: Path) -> None:
    out = tmp_path / "inspect.json"
    r = CliRunner().invoke(app, ["inspect", "--json-out", str(out)])
    assert r.exit_code == 0, r.output
    doc = json.loads(out.read_text())
    assert doc["schema"] == "llmdoctor.inspect/1" and doc["verdict"] == "parsed"
    assert not r.stdout.lstrip().startswith("{")  # the terminal still gets the human summary
    both = tmp_path / "both.json"
    r = CliRunner().invoke(app, ["inspect", "--json", "--json-out", str(both)])
    assert json.loads(r.stdout) == json.loads(both.read_text())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_an_error_is_written_to_json_out(tmp_path: Path) -> None:
    out = tmp_path / "error.json"
    r = CliRunner().invoke(app, ["inspect", str(tmp_path / "missing.gguf"), "--json-out", str(out)])
    assert r.exit_code == 2
    doc = json.loads(out.read_text())
    assert doc["verdict"] == "error" and doc["exit_code"] == 2
