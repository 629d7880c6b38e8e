"""README.md's three commands are the ones CI runs, and the main job works."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> dict[str, str]:
    """The first line of the fenced block after each `<!-- marker -->` in README.md."""
    text = (ROOT / "README.md").read_text()
    out = {}
    for marker in ("install", "main-job", "test"):
        m = re.search(rf"<!-- {marker} -->\n```[a-z]*\n(.+)\n", text)
        assert m, f"README.md has no {marker} block"
        out[marker] = m.group(1)
    return out


def test_readme_starts_with_install_then_main_job_then_test():
    text = (ROOT / "README.md").read_text()
    positions = [text.index(f"<!-- {m} -->") for m in ("install", "main-job", "test")]
    assert positions == sorted(positions)
    assert positions[0] < 1000, "the install command must be near the top"
    cmds = readme_commands()
    assert "pip install" in cmds["install"] and "-e '.[test]'" in cmds["install"]
    assert cmds["main-job"].startswith("llmdoctor ")
    assert "pytest" in cmds["test"]


def test_ci_runs_the_readme_commands_verbatim():
    p = subprocess.run(["bash", str(ROOT / ".ci/run"), "--print-commands"], capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    cmds = readme_commands()
    assert p.stdout.splitlines() == [cmds["install"], cmds["main-job"], cmds["test"]]
    ci = (ROOT / ".ci/run").read_text()
    assert 'eval "$INSTALL"' in ci and 'eval "$MAIN_JOB"' in ci and 'eval "$TEST"' in ci
    assert '"$rc" -eq 5' in ci  # pytest's "no tests" must not pass
    # the README's commands run in a virtual environment made afresh on every run (issue 24)
    fresh = ci.index('rm -rf "$CI_VENV"'), ci.index('python3 -m venv "$CI_VENV"'), ci.index('. "$CI_VENV/bin/activate"')
    assert list(fresh) == sorted(fresh) and fresh[-1] < ci.index('eval "$INSTALL"')


def test_readme_main_job_runs():
    cmd = readme_commands()["main-job"]
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip()
