"""A child Python process whose output a test reads line by line (see test_elastic)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest


def start(script, *args, stdin: bool = False) -> subprocess.Popen:
    """Runs ``python script args...``; its output lines go to ``p.lines`` (None: it ended)."""
    p = subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    p.lines = queue.Queue()

    def read():
        for out in p.stdout:
            p.lines.put(out)
        p.lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return p


def line(p: subprocess.Popen, timeout: float = 60) -> list[str]:
    """The child's next line of output, split (fails with its stderr if it ends first)."""
    try:
        out = p.lines.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no output from the child within {timeout} s")
    if out is None:
        pytest.fail(f"the child exited ({p.wait(10)}): {p.stderr.read()}")
    return out.split()


def end(p: subprocess.Popen) -> None:
    """Kills the child if it still runs, reaps it and closes its pipes."""
    if p.poll() is None:
        p.kill()
    p.wait(10)
    for stream in (p.stdin, p.stdout, p.stderr):
        if stream is not None:
            stream.close()


@contextlib.contextmanager
def session(argv: list, cwd, **popen):
    """``argv`` in ``cwd``, in its own session; its process group is SIGKILLed at the end,
    whatever happens."""
    proc = subprocess.Popen(argv, cwd=cwd, start_new_session=True, **popen)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=30)


def launched(cwd, *args: str, stdout=subprocess.PIPE):
    """``stalewise run ARGS`` in ``cwd``, as :func:`session`."""
    argv = [sys.executable, "-m", "stalewise", "run", *args]
    return session(argv, cwd, stdout=stdout, stderr=subprocess.PIPE, text=True)


def descendants(pid: int) -> set[int]:
    """The processes ``pid`` started, and theirs, down the tree (from /proc)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{p}/task/{task}/children") as f:
                    kids = {int(c) for c in f.read().split()} - found
                    found |= kids
                    todo += kids
    return found


def left(pids: set[int], within: float) -> set[int]:
    """Those of ``pids`` still running (not zombies) after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        alive = set()
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)
