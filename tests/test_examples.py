"""The examples in examples/ run as scripts and their asynchronous training works."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ACCURACY = 0.9  # the asynchronous run's printed training accuracy must reach this
ASYNC_LINE = re.compile(r"^\d+ async workers:\s+training accuracy (\d+\.\d+)$", re.MULTILINE)
PLAIN_LINE = re.compile(r"^plain loop:\s+training accuracy (\d+\.\d+)$", re.MULTILINE)


@pytest.mark.parametrize(
    ("script", "backend"), [("torch_async.py", "torch"), ("jax_async.py", "jax")]
)
def test_example_trains_asynchronously(script, backend):
    pytest.importorskip(backend)
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, out
    assert PLAIN_LINE.search(proc.stdout), out
    found = ASYNC_LINE.findall(proc.stdout)
    assert len(found) == 1, out
    assert float(found[0]) >= ACCURACY, out
