"""Process helpers shared by the local runtime's shard and worker processes."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator
from multiprocessing import connection, forkserver, util
from multiprocessing import spawn as mp_spawn
from typing import Any

from stalewise.runtime.base import THREAD_VARS


@contextlib.contextmanager
def thread_budget(threads: int, hold: bool = True) -> Iterator[None]:
    """Caps the math-library threads of processes spawned inside the block (not variables the
    user set). ``hold``: no other thread changes the environment meanwhile."""
    # every process the local runtime starts starts here: one still importing __main__ has no guard
    if getattr(mp.current_process(), "_inheriting", False):
        print(f"stalewise: {MAIN_GUARD_HINT}", file=sys.stderr, flush=True)
        raise SystemExit(NO_MAIN_GUARD)
    with _environ:
        unset = [k for k in THREAD_VARS if k not in os.environ]
        os.environ.update(dict.fromkeys(unset, str(max(1, threads))))
    try:
        with _environ if hold else contextlib.nullcontext():
            yield
    finally:
        with _environ:
            for k in unset:
                os.environ.pop(k, None)


_environ = threading.RLock()  # thread_budget's changes to os.environ (a spawn copies it)


def thread_share(workers: int) -> int:
    """Math-library threads for each of ``workers`` processes: a share of the cores, at least 1."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def cap_threads_here(workers: int) -> None:
    """Caps torch's threads here to a share of the cores, unless one of ``THREAD_VARS`` is set."""
    if any(k in os.environ for k in THREAD_VARS):
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(thread_share(workers))


class Capped:
    """``evaluate`` on at most ``threads`` math-library threads (OpenMP, BLAS: numpy's and
    torch's) unless one of ``THREAD_VARS`` is set: beside the workers, uncapped, it takes
    every core."""

    def __init__(self, evaluate: Callable, threads: int):
        self.evaluate, self.threads, self.libs = evaluate, threads, None
        self.free = any(k in os.environ for k in THREAD_VARS)

    def __call__(self, params: Any) -> Any:
        if self.free:
            return self.evaluate(params)
        from threadpoolctl import ThreadpoolController, threadpool_limits

        first = self.libs is None  # then the libraries it loads are found for the calls after
        with threadpool_limits(self.threads) if first else self.libs.limit(limits=self.threads):
            out = self.evaluate(params)
        if first:
            self.libs = ThreadpoolController()
        return out


#: The exit code of a spawned process whose main module lacks ``if __name__ == "__main__":``.
NO_MAIN_GUARD = 72
MAIN_GUARD_HINT = (
    "spawned processes re-import your main module, which started training again: put the "
    'code that starts training under `if __name__ == "__main__":`'
)


# -- the main module of a spawned process (why: docs/design-notes.md, "Local runtime") --

_own_main = threading.local()  # .on: the processes this thread starts leave __main__ out
_install_lock = threading.Lock()


# multiprocessing's entry point, but a child whose parent died while starting it exits quietly
_QUIET_ENTRY = """import os
from multiprocessing.spawn import spawn_main
try:
    spawn_main({args})
except Exception:
    if os.getppid() == {parent}:
        raise
    os._exit(70)
"""


def _install() -> None:
    """Wraps ``multiprocessing.spawn.get_preparation_data`` and ``get_command_line`` once:
    unchanged unless the calling thread is inside :func:`stalewise_main`."""
    with _install_lock:
        current, line = mp_spawn.get_preparation_data, mp_spawn.get_command_line
        if getattr(current, "_stalewise", False):
            return

        def get_preparation_data(name: str) -> dict:
            data = current(name)
            if getattr(_own_main, "on", False):  # the child does not import __main__
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
            return data

        def get_command_line(**kwds: object) -> list[str]:
            cmd = line(**kwds)
            if getattr(_own_main, "inside", False) and "-c" in cmd:
                at = cmd.index("-c") + 1
                args = ", ".join(f"{k}={v!r}" for k, v in kwds.items())
                cmd[at] = _QUIET_ENTRY.format(args=args, parent=os.getpid())
            return cmd

        get_preparation_data._stalewise = True  # type: ignore[attr-defined]
        mp_spawn.get_preparation_data = get_preparation_data
        mp_spawn.get_command_line = get_command_line


@contextlib.contextmanager
def stalewise_main(needs_main: bool = False) -> Iterator[None]:
    """Processes this thread spawns inside the block do not import the parent's ``__main__``."""
    _install()
    before = getattr(_own_main, "on", False), getattr(_own_main, "inside", False)
    _own_main.on, _own_main.inside = not needs_main, True
    try:
        yield
    finally:
        _own_main.on, _own_main.inside = before


class _MainFinder(pickle.Pickler):
    """Pickles into nothing, noting whether a class or function of ``__main__`` is used."""

    found = False

    def reducer_override(self, obj: object) -> object:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) and (
            getattr(obj, "__module__", None) in ("__main__", "__mp_main__")
        ):
            self.found = True
        return NotImplemented


def refers_to_main(obj: object) -> bool:
    """Whether pickling ``obj`` refers to a class or function of ``__main__`` (True if it
    does not pickle here, so the real start raises the real error).

    Example:
        >>> refers_to_main({"lr": 0.1}), refers_to_main(refers_to_main)
        (False, False)
    """
    try:
        with open(os.devnull, "wb") as nowhere:
            finder = _MainFinder(nowhere, protocol=5, buffer_callback=lambda buf: False)
            finder.dump(obj)
    except Exception:
        return True
    return finder.found


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def kill_me_with_parent() -> None:
    """The kernel SIGKILLs this process when the thread that started it ends (Linux)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def die_with_parent(cleanup: Callable[[], None] | None = None) -> None:
    """Makes this child of multiprocessing exit as soon as the process that started it dies (call it
    first thing): :func:`kill_me_with_parent` unless ``cleanup`` (a forked shard, whose OS parent
    is the forkserver), and a thread that waits on the parent's sentinel and runs ``cleanup``."""
    if cleanup is None:
        kill_me_with_parent()
    sentinel = mp.parent_process().sentinel  # type: ignore[union-attr]
    if connection.wait([sentinel], 0):  # the parent died before we could ask
        _parent_gone(sentinel, cleanup)
    if cleanup is not None:  # an exit of its own that finds the parent gone (its pipe ended)
        util.Finalize(None, _orphaned, args=(sentinel, cleanup), exitpriority=0)
    threading.Thread(
        target=_parent_gone, args=(sentinel, cleanup), name="stalewise-parent", daemon=True
    ).start()


def _orphaned(sentinel: int, cleanup: Callable[[], None]) -> None:
    """Runs ``cleanup`` if the parent is gone."""
    if connection.wait([sentinel], 0):
        with contextlib.suppress(Exception):
            cleanup()


def _parent_gone(sentinel: int, cleanup: Callable[[], None] | None) -> None:
    connection.wait([sentinel])
    if cleanup is not None:
        _orphaned(sentinel, cleanup)
    os._exit(70)  # no atexit handlers, no flushing of state the parent owned


# -- where shard processes start (why: docs/design-notes.md, "Local runtime") --

_warm: Any = None  # the forkserver's Popen class, once started (None again in a forked child)
_servers = 0  # the servers that asked for a context here
os.register_at_fork(after_in_child=lambda: globals().update(_warm=None))


class _Forked(mp.process.BaseProcess):
    """A process forked from the forkserver of :func:`shard_context`, writing to the stdout and
    stderr its parent has when it starts (not to those the forkserver was started with)."""

    _start_method = "forkserver"
    _stdio: dict[int, int] = {}  # noqa: RUF012 (the parent's fds 1, 2: their place among those sent)

    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _warm(process_obj)

    def _bootstrap(self, parent_sentinel: Any = None) -> int:
        for fd, at in self._stdio.items():
            os.dup2(forkserver.get_inherited_fds()[at], fd)
        return super()._bootstrap(parent_sentinel)  # type: ignore[misc]


class _ForkedContext(mp.context.BaseContext):
    _name, Process = "forkserver", _Forked


def shard_context() -> Any:
    """Forks from this process's own forkserver (``runtime.local.warm`` preloaded, math libraries
    capped at one thread) on Linux once the main thread started it, for its second server on;
    else spawns (one server's shards do not pay for the forkserver's start)."""
    global _warm, _servers
    main, _servers = threading.current_thread() is threading.main_thread(), _servers + 1
    if _warm is None and main and _servers > 1 and sys.platform.startswith("linux"):
        from multiprocessing import popen_forkserver

        server = forkserver.ForkServer()  # multiprocessing's own stays the user's
        server.set_forkserver_preload(["stalewise.runtime.local.warm"])
        server.read_signed = forkserver.read_signed  # type: ignore[attr-defined]
        # multiprocessing's own launch, its module-level forkserver replaced by this one
        code, names = popen_forkserver.Popen._launch.__code__, vars(popen_forkserver)
        launch = types.FunctionType(code, {**names, "forkserver": server})

        def stdio_launch(popen: Any, process_obj: _Forked) -> None:
            popen.reaping = threading.Lock()
            fds = [fd for fd in (1, 2) if os.path.exists(f"/proc/self/fd/{fd}")]
            process_obj._stdio = {fd: popen.duplicate_for_child(fd) for fd in fds}
            launch(popen, process_obj)

        def poll(popen: Any, flag: int = os.WNOHANG) -> int | None:
            with popen.reaping:  # the exit code is read once: a second thread would read 255
                return popen_forkserver.Popen.poll(popen, flag)

        with thread_budget(1):
            server.ensure_running()
        _warm = type("Popen", (popen_forkserver.Popen,), {"_launch": stdio_launch, "poll": poll})
    if _warm is None:
        return mp.get_context("spawn")
    return _ForkedContext()


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, for messages: ``exit code 3``, ``killed by SIGKILL``.

    Example:
        >>> describe_exit(NO_MAIN_GUARD).split(":")[0]
        'exit code 72'
    """
    if exitcode == NO_MAIN_GUARD:
        return f"exit code {exitcode}: {MAIN_GUARD_HINT}"
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
