"""Findings as SARIF 2.1.0 (OASIS Static Analysis Results Interchange Format), from the JSON envelope.

One run; one rule per check (`ruleId` = the finding's check); one result per finding: a failed
finding is kind "fail" at level "error", a passed one kind "pass", a skipped one kind
"notApplicable" (levels "none": SARIF §3.27.9 says a non-fail result has level none). The location
is the model file (physicalLocation) and the tensors or metadata keys the finding names
(logicalLocations, kind "resource" / "property"; a chat-template construct as `key:line`). The finding's
metrics, budget and reason travel in the result's property bag.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SCHEMA_URI = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
_TENSOR = re.compile(r"^[\w.\-]+\.(weight|bias)$|^blk\.\d+\.")
_KEY = re.compile(r"^[a-z0-9_\-]+(\.[a-z0-9_\-]+)+$")
_KIND = {"fail": ("fail", "error"), "pass": ("pass", "none"), "skip": ("notApplicable", "none")}


def _logical(f: dict[str, Any]) -> list[dict[str, str]]:
    """The tensors and keys a finding names: its evidence's "tensor" / "key" (a chat-template line as
    `key:line` in fullyQualifiedName: the line is the template's, not the binary file's), else its target."""
    names: list[dict[str, str]] = []
    for e in f.get("evidence") or []:
        if isinstance(e, dict):
            for field, kind in (("tensor", "resource"), ("key", "property")):
                if isinstance(e.get(field), str):
                    loc = {"name": e[field], "kind": kind}
                    if isinstance(e.get("line"), int):
                        loc["fullyQualifiedName"] = f"{e[field]}:{e['line']}"
                    if loc not in names:
                        names.append(loc)
    t = f.get("target", "")
    if not names and isinstance(t, str):
        if _TENSOR.match(t):
            names.append({"name": t, "kind": "resource"})
        elif _KEY.match(t):
            names.append({"name": t, "kind": "property"})
    return names[:8]


def to_sarif(doc: dict[str, Any]) -> dict[str, Any]:
    """A SARIF 2.1.0 log (dict) for a command's envelope `doc` (report/envelope.py)."""
    # the envelope's hashed file, else the model a command names without hashing it (verify)
    file = (doc.get("env") or {}).get("file") or {"path": (doc.get("model") or {}).get("path")}
    uri = Path(file["path"]).as_uri() if file.get("path") else None
    rules: dict[str, dict[str, Any]] = {}
    results = []
    for f in doc.get("findings", []):
        check = f.get("check") or "check"
        if check not in rules:
            rules[check] = {"id": check, "name": check,
                            "shortDescription": {"text": f.get("hypothesis") or check}}
        kind, level = _KIND[f.get("status", "skip")]
        text = f.get("explanation") or f.get("reason") or f"{check} {f.get('status')}"
        if f.get("status") == "skip" and not text.startswith("skipped"):
            text = f"skipped: {text}"
        loc: dict[str, Any] = {}
        if uri:
            loc["physicalLocation"] = {"artifactLocation": {"uri": uri, "index": 0}}
        if logical := _logical(f):
            loc["logicalLocations"] = logical
        result: dict[str, Any] = {
            "ruleId": check, "ruleIndex": list(rules).index(check), "kind": kind, "level": level,
            "message": {"text": text},
            "properties": {k: f[k] for k in ("id", "subject", "target", "metrics", "budget", "reason", "confidence")
                           if f.get(k) not in (None, "", {}, [])},
        }
        if loc:
            result["locations"] = [loc]
        results.append(result)
    run: dict[str, Any] = {
        "tool": {"driver": {"name": "llmdoctor", "version": str(doc.get("version", "")),
                            "informationUri": "https://github.com/llmdoctor/llmdoctor",
                            "rules": list(rules.values())}},
        "invocations": [{"executionSuccessful": doc.get("exit_code") in (0, 1),
                         "exitCode": int(doc.get("exit_code", 0)),
                         "commandLine": " ".join(["llmdoctor", *map(str, doc.get("argv", []))])}],
        "results": results,
        "properties": {"schema": doc.get("schema"), "verdict": doc.get("verdict"), "counts": doc.get("counts")},
    }
    if uri:
        run["artifacts"] = [{"location": {"uri": uri},
                             **({"hashes": {"sha-256": file["sha256"]}} if file.get("sha256") else {})}]
    return {"$schema": SCHEMA_URI, "version": "2.1.0", "runs": [run]}


def write(path: str | Path, doc: dict[str, Any]) -> None:
    """Write the SARIF log of envelope `doc` to `path` atomically (non-finite numbers as strings)."""
    from .envelope import dumps, write_atomic

    write_atomic(path, dumps(to_sarif(doc)))
