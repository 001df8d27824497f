"""Project habits that CI enforces: lint, format, and the README's commands."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ["stalewise", "tests", "benchmarks", "examples"]


def test_ruff_lint_and_format_are_clean():
    lint = subprocess.run(
        [sys.executable, "-m", "ruff", "check", *CODE], cwd=ROOT, capture_output=True, text=True
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *CODE],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_readme_opens_with_the_demo_and_test_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [line.strip() for line in lines[:8] if line.startswith("    ")]
    assert len(commands) == 2
    demo, tests = commands
    assert demo.endswith("stalewise demo") and "pip install" in demo
    assert "pytest" in tests and "'.[test]'" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"sed -n .*pytest", ci), ".ci/run must take its test command from the README"


def test_readme_is_short_enough_to_read():
    """A user's README: what stalewise is, the demo, the three ways in, where next.
    Figures live in docs/benchmarks.md, the history of a figure in the commit log."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move details to docs/"
