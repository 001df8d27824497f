"""The examples in examples/ run as scripts and their asynchronous training works."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
ACCURACY = 0.9  # the asynchronous run's printed training accuracy must reach this
ASYNC_LINE = re.compile(r"^\d+ async workers:\s+training accuracy (\d+\.\d+)$", re.MULTILINE)
PLAIN_LINE = re.compile(r"^plain loop:\s+training accuracy (\d+\.\d+)$", re.MULTILINE)


@pytest.mark.slow
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


README = EXAMPLES.parent / "README.md"


def readme_snippets() -> list[str]:
    snippets = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(snippets) == 3, "a snippet was added or removed: update this test"
    return snippets


@pytest.fixture(scope="module")
def snippets_run(tmp_path_factory) -> list[subprocess.CompletedProcess]:
    """Each README snippet run as pasted (``python snippet.py`` in a folder of its own),
    the three at once, each in its own session; every session still there after 300 s or
    when this ends is killed."""
    procs = []
    try:
        for snippet in readme_snippets():
            folder = tmp_path_factory.mktemp("snippet")
            (folder / "snippet.py").write_text(snippet)
            procs.append(subprocess.Popen(
                [sys.executable, "snippet.py"], cwd=folder, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True,
            ))  # fmt: skip
        deadline = time.monotonic() + 300
        outs = [p.communicate(timeout=max(deadline - time.monotonic(), 0.1)) for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):  # the snippet and its children
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, *out)
        for p, out in zip(procs, outs, strict=True)
    ]


@pytest.mark.parametrize("index", range(3))
def test_readme_python_snippets_run_as_pasted(index, snippets_run):
    assert len(readme_snippets()) == 3, "a snippet was added or removed: update this test"
    proc = snippets_run[index]
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    expected = ["'loss':", "2 applied (3,)", "held-out accuracy"][index]
    assert expected in proc.stdout, proc.stdout


def test_the_elastic_example_joins_and_leaves(no_leaks):
    """examples/elastic_attach.py: two processes attach and leave, a third joins after
    them; 60 pushes bring w from 0 to 3 (each worker's own process, its own session,
    killed if it outlives the test)."""
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLES / "elastic_attach.py")], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "w = 2.99" in out and "after 60 pushes from 3 processes" in out, out


def test_the_torch_launch_example_changes_at_most_ten_lines():
    """train_plain -> train of examples/torch_launch.py: the issue's bar of 10 lines."""
    import ast
    import difflib

    source = (EXAMPLES / "torch_launch.py").read_text()
    lines = source.splitlines()
    funcs = {f.name: f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef)}

    def body(name):
        return lines[funcs[name].lineno - 1 : funcs[name].end_lineno]

    diff = list(difflib.unified_diff(body("train_plain"), body("train"), lineterm="", n=20))
    assert 0 < sum(line.startswith("+") for line in diff[2:]) <= 10, "\n".join(diff)


LAUNCHED_LINE = re.compile(r"^rank (\d) of 2: training accuracy (\d+\.\d+)$", re.MULTILINE)


def test_the_launched_torch_example_trains_on_two_workers(no_leaks):
    """``stalewise run --workers 2`` of examples/torch_launch.py: both ranks train the
    one global model to the plain loop's accuracy bar, within the script's budget."""
    proc = subprocess.run(
        [sys.executable, "-m", "stalewise", "run", "--workers", "2", "--steps", "300",
         str(EXAMPLES / "torch_launch.py")],
        cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, out
    found = sorted(LAUNCHED_LINE.findall(proc.stdout))
    assert [rank for rank, _ in found] == ["0", "1"], out
    assert all(float(acc) >= ACCURACY for _, acc in found), out
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"stalewise run: 2 workers done, 30[01] pushes", last), out
