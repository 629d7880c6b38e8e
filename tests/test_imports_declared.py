"""Every third-party module that src/ or tests/ imports is declared in pyproject.toml (issue 24).

A fresh clone installs only what pyproject.toml declares; a package that merely happens to be in a
used development environment makes CI green and a new user's `pytest` fail at collection. The rule:
- a module imported under src/ is provided by a distribution named in `[project] dependencies`;
- a module imported under tests/ by one named there or in the `test` extra.
"Provided by" is decided by `importlib.metadata.packages_distributions()` (import name ->
distributions installed here), so the declaration must name the distribution itself, not a package
that happens to pull it in (a transitive dependency can vanish with an upstream release).

Modules that llmdoctor never installs are listed in OUTSIDE_OUR_ENVIRONMENT with the reason; every
import of them is inside a function that runs only where they exist.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OUTSIDE_OUR_ENVIRONMENT = {
    "vllm": "the deployment's own interpreter (--engine-python): vllm_driver.py runs there; its GPU kernels as subjects",
    "vllm_gguf_plugin": "the deployment's own interpreter, beside vllm",
    "triton": "ships with CUDA builds of torch; imported only for the GPU paths",
    "flash_attn": "an optional GPU attention subject, imported only when named",
    "flashinfer": "an optional GPU attention subject, imported only when named",
}


def _normal(name: str) -> str:
    """PEP 503 normal form of a distribution name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert match, f"unparsable requirement {requirement!r}"
    return _normal(match.group(1))


def declared(pyproject: Path) -> tuple[set[str], set[str]]:
    """(distributions in `dependencies`, those plus the `test` extra), normalized."""
    project = tomllib.loads(pyproject.read_text())["project"]
    runtime = {_requirement_name(r) for r in project.get("dependencies", [])}
    test = {_requirement_name(r) for r in project.get("optional-dependencies", {}).get("test", [])}
    return runtime, runtime | test


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in one file (module level and inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def undeclared_imports(files: list[Path], allowed: set[str], local: set[str],
                       providers: dict[str, list[str]]) -> list[str]:
    """'module (file): why' for each third-party import no allowed distribution provides."""
    problems = []
    for path in sorted(files):
        for module in sorted(imported_modules(path)):
            if module in sys.stdlib_module_names or module in local or module in OUTSIDE_OUR_ENVIRONMENT:
                continue
            dists = {_normal(d) for d in providers.get(module, [])}
            if not dists:
                problems.append(f"{module} ({path.name}): no installed distribution provides it")
            elif not dists & allowed:
                problems.append(f"{module} ({path.name}): provided by {', '.join(sorted(dists))}, which is not declared")
    return problems


def _local_names(root: Path) -> set[str]:
    """The project's own import names: the package and the tests' modules (imported by name)."""
    return {"llmdoctor"} | {p.stem for p in (root / "tests").rglob("*.py")}


def audit(root: Path) -> list[str]:
    runtime, with_test = declared(root / "pyproject.toml")
    providers = packages_distributions()
    local = _local_names(root)
    return (undeclared_imports(list((root / "src").rglob("*.py")), runtime, local, providers)
            + undeclared_imports(list((root / "tests").rglob("*.py")), with_test, local, providers))


def test_every_import_is_declared():
    problems = audit(ROOT)
    assert not problems, "imported but not declared in pyproject.toml:\n" + "\n".join(problems)


def _project(tmp_path: Path, test_source: str, src_source: str = "import numpy\n") -> Path:
    """A minimal project tree: pyproject.toml declaring numpy (+ pytest for tests), one module, one test."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "pyproject.toml").write_text(
        '[project]\nname = "x"\nversion = "0"\ndependencies = ["numpy>=1.26"]\n'
        '[project.optional-dependencies]\ntest = ["pytest>=8"]\n')
    (tmp_path / "src" / "llmdoctor").mkdir(parents=True)
    (tmp_path / "src" / "llmdoctor" / "m.py").write_text(src_source)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(test_source)
    return tmp_path


def test_planted_undeclared_test_import_fails(tmp_path):
    """The audit fails when a test imports an installed package the project never declares (pip: in
    every venv, never in pyproject) and when it imports one that nothing installed provides."""
    clean = _project(tmp_path / "clean", "import pytest\nimport numpy\nfrom llmdoctor import m\n")
    assert audit(clean) == []
    planted = _project(tmp_path / "planted", "import pytest\n\ndef test_y():\n    import pip\n    import no_such_pkg_xyz\n")
    problems = audit(planted)
    assert any(p.startswith("pip (test_x.py): provided by pip") for p in problems), problems
    assert any(p.startswith("no_such_pkg_xyz (test_x.py): no installed distribution") for p in problems), problems


def test_test_extra_does_not_cover_src(tmp_path):
    """pytest is declared for the tests only: importing it from src/ is a finding."""
    planted = _project(tmp_path, "import pytest\n", src_source="import pytest\n")
    assert audit(planted) == ["pytest (m.py): provided by pytest, which is not declared"]
