"""The attention backends an engine built, against the ones its own selection code picks for this model,
dtype and platform (vLLM chooses at run time: a backend setting, an environment variable or a platform
quirk can make the running engine use another than the one its selection would)."""

from __future__ import annotations

from typing import Any


def mismatches(built: dict[str, Any], explained: dict[str, Any]) -> list[str]:
    """One line per layer whose decode (or, for MLA, prefill) backend differs from the selection.
    built: {"decode": {layer: backend}, "prefill": {layer: backend}} (the engine run's RunInfo.backends);
    explained: {"kind": dense | mla, "selected": {"decode", "prefill"}} (BackendSelecting.explain_backends)."""
    sel = explained.get("selected") or {}
    out = [f"{layer}: built {name}, selection says {sel.get('decode')}"
           for layer, name in built.get("decode", {}).items() if name != sel.get("decode")]
    if explained.get("kind") == "mla":
        out += [f"{layer}: built prefill {name}, selection says {sel.get('prefill')}"
                for layer, name in built.get("prefill", {}).items() if name != sel.get("prefill")]
    return out
