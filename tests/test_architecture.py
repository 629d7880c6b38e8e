"""The house is one-way (DESIGN.md "The idea in one picture", issue 21 part 3): every module under
src/llmdoctor is parsed with ast, its package-internal imports (module level and inside functions, and
modules named by string: a registry's list, a child process's "module:function") make a graph, and

- every edge runs down the layer table below (or stays inside one layer),
- the graph has no cycle but those through the registries listed in REGISTRIES (issue 21 cut the
  others: gguf reader <-> split, reference forward <-> checkpoint, subjects kernels <-> engines.vllm),
- an engine's driver (run by the deployment's interpreter, where llmdoctor is not installed) imports
  nothing of the package.

The layer table, lowest first; a module may import its own layer, any lower layer, and the base:

    base       llmdoctor/__init__, errors, hf_config, native, file_digest, demo: leaves that import only
               each other (asserted), so whoever imports them cannot close a cycle or reach upward.
               errors is every layer's error type, hf_config the config.json reader gguf/layout.py,
               reference/ and checks/ share, native the C-extension loader of gguf/ and checks/,
               file_digest a file's cached sha256 (the envelope's provenance today; any check of a
               file may want it), demo the default model path of every command and the demo faults,
               outcomes what an isolated subject answers (subjects/ fill it in, checks/ judge it),
               completion what an endpoint answers (subjects/endpoint.py fills it in, the probes judge it).
    gguf       the file: read, decode, layouts.
    reference  the truth: never imports subjects/ (DESIGN), nor anything above.
    subjects   the suspects: may use the reference (e.g. its config to build an engine's model).
    checks     hypothesis -> evidence -> verdict, asking subjects.
    report     renders findings (checks/base.py's Finding) and "knows nothing of how they were
               measured": of checks/ it may import only checks.base.
    diagnose   the elimination plan over the checks, rendered by report/.
    faults     planted faults: may import anything below cli (they wrap kernels, engines, checks'
               inputs), and nothing below imports them: a check gets a planted fault handed in by its
               caller (checks/file/sharding.py `run(..., plant=)`).
    cli        the typer app: may import everything.

One more rule (issue 33): checks/ never imports subjects/, although subjects sit below it: a check judges
what a subject measured (or a subject its caller opened and handed in: cli.py, diagnose/), never starts one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import llmdoctor

SRC = Path(llmdoctor.__file__).parent

# names below the package
BASE = frozenset(("", "errors", "hf_config", "native", "file_digest", "demo", "outcomes", "completion"))
LAYERS = ("gguf", "reference", "subjects", "checks", "report", "diagnose", "faults", "cli")  # lowest first
REPORT_MAY_IMPORT_FROM_CHECKS = frozenset(("checks.base",))

# Registry cycles: the loader imports its members (lazily, or by name) and each member imports the
# loader to register itself. The edges loader -> member are left out of the cycle search.
REGISTRIES = {
    # gguf/dequant.py `_load_kernels` imports the block-kernel modules, which `register` into it
    "gguf.dequant": "gguf.dequant_",
    # reference/config.py imports the architecture modules by name; each registers its GGUF/HF
    # config parsers (config.register_gguf/register_hf) and its block (forward.register_block)
    "reference.config": "reference.arch_",
    # faults/__init__.py `_MODULES`: the one registry of planted faults, each module `register`s into it
    "faults": "faults.",
}


# ---- the graph -------------------------------------------------------------------------------------

def modules(root: Path) -> dict[str, Path]:
    """Dotted name (relative to the package, "" for the package itself) -> file, for every module."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _target(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` (a dotted name below the package) is or lies in."""
    while name not in known:
        if not name:
            return None
        name = name.rpartition(".")[0]
    return name


def imports(module: str, path: Path, known: dict[str, Path], package: str) -> set[str]:
    """The package's modules `module` imports: import statements anywhere in it (relative or absolute),
    and string constants that name a module exactly ("pkg.a.b", or "pkg.a.b:function": import_module's
    argument, a registry's list, a child process's entry point)."""
    out: set[str] = set()
    here = module.split(".") if module else []
    own = here if path.name == "__init__.py" else here[:-1]  # the package `from . import` means

    def below(dotted: str) -> str | None:  # "pkg.a.b" -> "a.b"; None outside the package
        if dotted == package:
            return ""
        return dotted[len(package) + 1:] if dotted.startswith(package + ".") else None

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [below(a.name) for a in node.names]
            out.update(t for n in names if n is not None and (t := _target(n, known)) is not None)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(own[:len(own) - (node.level - 1)] + ([node.module] if node.module else []))
            elif (base := below(node.module or "")) is None:
                continue
            for a in node.names:  # `from pkg.a import b`: the module a.b when it is one, else a
                sub = f"{base}.{a.name}" if base else a.name
                t = sub if sub in known else _target(base, known)
                if t is not None:
                    out.add(t)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = below(node.value.split(":", 1)[0])
            if name and name in known:  # the bare package name is the distribution's, not an import
                out.add(name)
    out.discard(module)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports, for the package at `root` (names relative to it)."""
    known = modules(root)
    return {m: imports(m, p, known, root.name) for m, p in known.items()}


# ---- the rules -------------------------------------------------------------------------------------

def layer(module: str) -> str | None:
    """The module's layer: "base", one of LAYERS, or None (not placed: a new top-level module must be)."""
    if module in BASE:
        return "base"
    top = module.split(".")[0]
    return top if top in LAYERS else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer table, as "a -> b (why)"."""
    bad = []
    for a, targets in sorted(graph.items()):
        la = layer(a)
        if la is None:
            bad.append(f"{a}: not in a layer (add it to BASE or a layer of tests/test_architecture.py)")
            continue
        for b in sorted(targets):
            lb = layer(b)
            if lb == "base":
                continue  # anyone may import the base
            if la == "base":
                bad.append(f"{a} -> {b} (a base module imports only base modules)")
            elif lb is not None and LAYERS.index(lb) > LAYERS.index(la):
                bad.append(f"{a} -> {b} ({la} is below {lb})")
            elif la == "report" and lb == "checks" and b not in REPORT_MAY_IMPORT_FROM_CHECKS:
                bad.append(f"{a} -> {b} (report knows only checks.base's findings)")
            elif la == "checks" and lb == "subjects":
                bad.append(f"{a} -> {b} (a check receives what a subject measured; its caller opens the subject)")
    return bad


def _registry_edge(a: str, b: str) -> bool:
    member = REGISTRIES.get(a)
    return member is not None and b.startswith(member)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), registry edges left out."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if _registry_edge(v, w):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# ---- the tests -------------------------------------------------------------------------------------

def test_layers_run_one_way():
    """No import runs up the layer table: reference never imports subjects, checks never import faults,
    report never the checks' machinery, a base module nothing above the base."""
    assert upward(import_graph(SRC)) == []


def test_no_cycles_but_registries():
    """No import cycle except through a registry (REGISTRIES)."""
    graph = import_graph(SRC)
    assert cycles(graph) == []
    for loader, member in REGISTRIES.items():  # a registry that no longer loads anything is stale
        assert any(b.startswith(member) for b in graph[loader]), f"REGISTRIES[{loader!r}] loads nothing"


def test_engine_drivers_import_nothing_of_ours():
    """A driver runs in the deployment's interpreter, where llmdoctor is not installed (DESIGN.md
    "Engines in their own environment"): it imports no module of the package."""
    graph = import_graph(SRC)
    drivers = [m for m in graph if m.rpartition(".")[2].endswith("_driver")]
    assert drivers, "no engine driver found (renamed? update this test)"
    assert {m: sorted(graph[m]) for m in drivers if graph[m]} == {}


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A synthetic package `llmdoctor` under root: {relative path: source}, __init__.py added."""
    pkg = root / "llmdoctor"
    for rel, src in files.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    for d in [pkg, *(p for p in pkg.rglob("*") if p.is_dir())]:
        (d / "__init__.py").touch()
    return pkg


def test_the_rules_can_fail(tmp_path):
    """The same graph and rules on a planted tree: each kind of bad import is caught, in each form of
    import statement (module level, inside a function, relative, absolute, by name in a string)."""
    pkg = _tree(tmp_path, {
        "errors.py": "",
        "gguf/reader.py": "from ..errors import GGUFError\n"
                          "def f():\n    from ..checks import base  # upward, inside a function\n",
        "gguf/split.py": "from .reader import f\n",
        "reference/forward.py": "import llmdoctor.subjects.kernels\n",  # reference -> subjects
        "subjects/kernels.py": "from llmdoctor.gguf import split\n",
        "checks/base.py": "",
        "checks/file/sharding.py": "def plan():\n    from ...faults import get\n",  # checks -> faults
        "checks/metrics.py": "ENTRY = 'llmdoctor.report.html:render'\n",  # checks -> report, by name
        "checks/kernels/dequant.py": "def run():\n    from ...subjects import kernels\n",  # checks -> subjects
        "report/html.py": "from ..checks import base, metrics\n",  # report -> checks.metrics
        "faults/__init__.py": "_MODULES = ('llmdoctor.faults.sharding',)\n",
        "faults/sharding.py": "from . import _MODULES\nfrom ..cli import app\n",  # faults -> cli
        "cli.py": "from .checks import sharding\nfrom . import faults\n",
        "errors_extra.py": "",  # a new top-level module nobody placed
        "native.py": "from .gguf import reader\n",  # the base reaching into a layer
        # a cycle that is no registry: a <-> b inside subjects
        "subjects/a.py": "from . import b\n",
        "subjects/b.py": "def f():\n    from .a import x\n",
    })
    graph = import_graph(pkg)
    assert graph["gguf.reader"] == {"errors", "checks.base"}
    assert graph["gguf.split"] == {"gguf.reader"}
    assert graph["checks.metrics"] == {"report.html"}
    assert graph["faults"] == {"faults.sharding"}
    bad = upward(graph)
    for want in ("gguf.reader -> checks.base (gguf is below checks)",
                 "reference.forward -> subjects.kernels (reference is below subjects)",
                 "checks.file.sharding -> faults (checks is below faults)",
                 "checks.metrics -> report.html (checks is below report)",
                 "checks.kernels.dequant -> subjects.kernels (a check receives what a subject measured; its caller "
                 "opens the subject)",
                 "report.html -> checks.metrics (report knows only checks.base's findings)",
                 "faults.sharding -> cli (faults is below cli)",
                 "native -> gguf.reader (a base module imports only base modules)",
                 "errors_extra: not in a layer (add it to BASE or a layer of tests/test_architecture.py)"):
        assert want in bad, (want, bad)
    assert not any(line.startswith(("gguf.split", "subjects.kernels", "cli ")) for line in bad), bad
    # the planted circles (checks.metrics names report.html in a string, report.html imports it back), and
    # not faults <-> faults.sharding: the registry's own cycle
    assert cycles(graph) == [["checks.metrics", "report.html"], ["subjects.a", "subjects.b"]]
