"""The attach door on a shared machine: whose folder it trusts, what it reads, and how it
stands a flood of connections at a low open-file limit (issue #28, items 1 and 5)."""

import contextlib
import json
import os
import pickle
import pwd
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import uuid
from multiprocessing import connection
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.local import attach as door

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Unix users and /proc: Linux")


@pytest.fixture
def base(monkeypatch):
    """A fresh ``XDG_RUNTIME_DIR`` that, like /tmp, every user may write (sticky, 1777)."""
    path = Path(tempfile.mkdtemp(prefix="sw-attach-", dir="/tmp"))
    path.chmod(0o1777)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _folder(base: Path) -> Path:
    return base / f"stalewise-{os.getuid()}"


def _job():
    return sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))


def _name():
    return f"test-{uuid.uuid4().hex[:8]}"


def _one_line(e: pytest.ExceptionInfo, *names: object) -> None:
    text = str(e.value)
    assert "\n" not in text, text
    for name in names:
        assert str(name) in text, text


class _Touch:
    """A pickle that, when loaded, creates the file ``path`` (the attacker's "code")."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


# -- another Unix user (as root) ------------------------------------------------------------

ATTACKER = textwrap.dedent(
    """
    # the attacker, running as another user: she makes the victim's attach folder first
    import os, socket, sys
    from multiprocessing import connection

    folder, what, target, payload = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    os.mkdir(folder, 0o755)
    if what == "symlink":
        os.symlink(target, os.path.join(folder, "gpt.key"))
        print("ready", flush=True)
        sys.exit(0)
    key = b"k" * 32
    with open(os.path.join(folder, "gpt.key"), "wb") as f:
        f.write(key)
    os.chmod(os.path.join(folder, "gpt.key"), 0o644)
    listener = connection.Listener(os.path.join(folder, "gpt.sock"), family="AF_UNIX")
    os.chmod(os.path.join(folder, "gpt.sock"), 0o777)
    print("ready", flush=True)
    conn = listener.accept()
    print("connected", flush=True)
    connection.deliver_challenge(conn, key)
    connection.answer_challenge(conn, key)
    conn.recv_bytes(256)
    conn.send_bytes(bytes.fromhex(payload))
    conn.recv_bytes(16)
    """
)


@pytest.fixture
def other_user(base):
    """Runs a script as ``nobody``; yields ``run(args) -> Popen`` (killed at the end)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second Unix user (nobody)")
    try:
        who = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    as_her = {"user": who.pw_uid, "group": who.pw_gid, "extra_groups": []}
    if python is None or subprocess.run([python, "-c", ""], **as_her, timeout=30).returncode:
        pytest.skip("no Python that user 'nobody' may run")
    script = base / "attacker.py"
    script.write_text(ATTACKER)
    script.chmod(0o644)
    started = []

    def run(*args):
        p = subprocess.Popen(
            [python, str(script), *map(str, args)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **as_her,
        )
        started.append(p)
        ready, _, _ = select.select([p.stdout], [], [], 30)
        assert ready and p.stdout.readline().strip() == "ready"
        return p

    yield run
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)
        p.stdout.close()


def test_a_folder_made_by_another_user_is_refused_and_runs_none_of_her_code(base, other_user):
    folder, marker = _folder(base), base / "her-code-ran"
    payload = pickle.dumps(("client", _Touch(str(marker)))).hex()
    her = other_user(folder, "door", "-", payload)
    assert folder.stat().st_uid != os.getuid()
    with pytest.raises(sw.AttachError) as e:
        sw.attach("gpt", timeout=10)
    _one_line(e, folder, "belongs to uid", "XDG_RUNTIME_DIR")
    with pytest.raises(sw.AttachError) as e:  # nor does a job serve its door there
        _job().serve(workers=1, name="gpt")
    _one_line(e, folder, "belongs to uid")
    assert not marker.exists()
    her.kill()
    assert "connected" not in her.communicate(timeout=10)[0]  # nobody came to her socket


def test_a_symlinked_key_in_another_users_folder_overwrites_nothing(base, other_user):
    precious = base / "precious.txt"
    precious.write_text("mine\n")
    other_user(_folder(base), "symlink", precious, "-")
    assert (_folder(base) / "gpt.key").is_symlink()
    with pytest.raises(sw.AttachError) as e:
        _job().serve(workers=1, name="gpt")
    _one_line(e, _folder(base), "belongs to uid")
    assert precious.read_text() == "mine\n"


# -- the same user ----------------------------------------------------------------------------


def test_a_folder_open_to_others_is_refused(base):
    folder = _folder(base)
    folder.mkdir()
    folder.chmod(0o755)
    with pytest.raises(sw.AttachError) as e:
        _job().serve(workers=1, name=_name())
    _one_line(e, folder, "mode 0755", f"chmod 700 {folder}")
    with pytest.raises(sw.AttachError) as e:
        sw.attach("gpt", timeout=10)
    _one_line(e, folder, "mode 0755")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o755  # not changed behind the user's back


def test_a_folder_that_is_a_symlink_is_refused(base):
    real = base / "elsewhere"
    real.mkdir(mode=0o700)
    _folder(base).symlink_to(real)
    with pytest.raises(sw.AttachError) as e:
        _job().serve(workers=1, name=_name())
    _one_line(e, _folder(base), "is a symlink")
    assert list(real.iterdir()) == []


def test_a_symlinked_key_is_neither_written_nor_read(base):
    name, precious = _name(), base / "precious.txt"
    precious.write_text("mine\n")
    keyfile = door.door_dir() / f"{name}.key"
    keyfile.symlink_to(precious)
    with pytest.raises(sw.AttachError) as e:  # serve: a key that is a symlink
        _job().serve(workers=1, name=name)
    _one_line(e, keyfile, "symlink")
    assert precious.read_text() == "mine\n"
    keyfile.unlink()
    with _job().serve(workers=(0, 1), name=name):  # attach: a served job's key, swapped
        copy = base / "key-copy"
        copy.write_bytes(keyfile.read_bytes())
        copy.chmod(0o600)
        keyfile.unlink()
        keyfile.symlink_to(copy)
        with pytest.raises(sw.AttachError) as e:
            sw.attach(name, timeout=10)
        _one_line(e, keyfile, "symlink")
        keyfile.unlink()  # the server removes its key at close: give it back a file
        shutil.copy(copy, keyfile)


def test_what_a_door_sends_is_never_unpickled(base):
    """A door that knows the key (say, a server of another version) answers with a pickle:
    the attaching process refuses it, in one line, and runs nothing."""
    name, marker = _name(), base / "pickle-ran"
    folder = door.door_dir()
    key = b"k" * 32
    fd = os.open(folder / f"{name}.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, key)
    os.close(fd)
    sock = str(folder / f"{name}.sock")
    listener = connection.Listener(sock, family="AF_UNIX")

    def serve():
        with contextlib.suppress(OSError, EOFError), listener.accept() as conn:
            connection.deliver_challenge(conn, key)
            connection.answer_challenge(conn, key)
            conn.recv_bytes(256)
            conn.send(("client", _Touch(str(marker))))  # a pickle, as the door once sent
            conn.poll(10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        with pytest.raises(sw.AttachError) as e:
            sw.attach(name, timeout=10)
        _one_line(e, name, "what no door sends")
        assert not marker.exists()
    finally:
        with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
            s.connect(sock)  # ends its accept, if attach never came
        listener.close()
        t.join(10)


PARAMS = textwrap.dedent(
    """
    import dataclasses
    from typing import NamedTuple

    import numpy as np

    @dataclasses.dataclass
    class Head:
        w: np.ndarray
        scale: float = dataclasses.field(default=2.0, metadata={"static": True})

    class Params(NamedTuple):
        body: dict
        head: Head
    """
)

ATTACHER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    if sys.argv[2] == "import":
        import {module} as m
    try:
        client = sw.attach(sys.argv[1], timeout=20)
    except sw.AttachError as e:
        print("refused:", e)
        sys.exit(0)
    p = client.pull()
    print(type(p).__name__, type(p.head).__name__, p.head.scale, p.body["b"].tolist())
    client.push(m.Params({{"b": np.ones(2, np.float32)}}, m.Head(np.ones(3, np.float32))))
    client.wait(timeout=20)
    client.close()
    """
)


def test_a_structure_travels_as_data_and_its_classes_are_never_imported_by_name(base, tmp_path):
    """A namedtuple and dataclass tree reaches a process that imported its module; one that
    did not is told to, in one line: the door never makes it import a module by name."""
    module = f"swparams_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(PARAMS)
    (tmp_path / "attacher.py").write_text(ATTACHER.format(module=module))
    sys.path.insert(0, str(tmp_path))
    try:
        m = __import__(module)
        params = m.Params({"b": np.zeros(2, np.float32)}, m.Head(np.zeros(3, np.float32)))
        job = sw.Job(params, optimizer=sw.optim.sgd(1.0))
        name = _name()
        with job.serve(workers=(0, 2), name=name) as server:
            for how in ("import", "no-import"):
                args = [sys.executable, str(tmp_path / "attacher.py"), name, how]
                code, out, err = _run(args, timeout=60)
                assert code == 0, err[-3000:]
                if how == "import":
                    assert out.split() == ["Params", "Head", "2.0", "[0.0,", "0.0]"], out
                    assert server.pull().head.w.tolist() == [-1.0, -1.0, -1.0]
                else:
                    assert out.startswith("refused:") and out.count("\n") == 1, out
                    assert f"class {module}." in out and "import its module" in out, out
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(module, None)


# -- out of file descriptors, flooded with silent connections --------------------------------

HELPER = textwrap.dedent(
    """
    # opens silent connections to a door when told, and holds them
    import resource, socket, sys, time

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))

    def connect(path):  # None if the door's backlog stays full for 5 s
        give_up = time.monotonic() + 5
        while time.monotonic() < give_up:
            s = socket.socket(socket.AF_UNIX)
            s.setblocking(False)
            try:
                s.connect(path)
                return s
            except BlockingIOError:  # the backlog is full: the door has not accepted yet
                s.close()
                time.sleep(0.001)

    held = []
    for line in sys.stdin:
        new = [connect(sys.argv[1]) for _ in range(int(line))]
        held += [s for s in new if s is not None]
        print(sum(s is not None for s in new), flush=True)
    """
)

FLOODED = textwrap.dedent(
    """
    # a served job, at a low open-file limit: a flood of silent connections, then no
    # descriptor left at all, while a worker of this process trains
    import json, logging, os, resource, subprocess, sys, threading, time
    import numpy as np
    import stalewise as sw

    helper_py, name = sys.argv[1], sys.argv[2]
    errors, logs = [], []
    threading.excepthook = lambda a: errors.append(f"{a.thread.name}: {a.exc_value!r}")

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logging.getLogger("stalewise").addHandler(Keep())
    logging.getLogger("stalewise").setLevel(logging.INFO)

    def cpu(tid):  # seconds of CPU thread tid has used
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def timed(call, *args, **kwargs):
        t0 = time.monotonic()
        out = call(*args, **kwargs)
        return out, time.monotonic() - t0

    def main():
        out = {}
        job = sw.Job({"w": np.zeros(1000, np.float32)}, optimizer=sw.optim.sgd(1e-6))
        with job.serve(workers=(1, 4), name=name) as server:
            sock = str(sw.runtime.local.attach.door_path(name))
            helper = subprocess.Popen([sys.executable, helper_py, sock], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
            mine = server.client(0)
            pushes, stop = [0], threading.Event()

            def train():
                g = {"w": np.ones(1000, np.float32)}
                while not stop.is_set():
                    mine.pull()
                    mine.push(g)
                    pushes[0] += 1

            trainer = threading.Thread(target=train, daemon=True)
            trainer.start()

            def rate(seconds):
                n0 = pushes[0]
                time.sleep(seconds)
                return (pushes[0] - n0) / seconds

            out["rate_quiet"] = rate(2.0)
            limit = max(os.listdir("/proc/self/fd"), key=int)
            limit = int(limit) + 64
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
            out["limit"] = limit

            # 1. a flood of silent connections, and an attach in the middle of it
            n0 = pushes[0]
            t0 = time.monotonic()
            helper.stdin.write("600\\n")
            helper.stdin.flush()
            time.sleep(0.3)
            client, out["attach_in_flood"] = timed(sw.attach, name, timeout=30)
            client.close()
            out["silent_opened"] = int(helper.stdout.readline())
            out["rate_flood"] = (pushes[0] - n0) / (time.monotonic() - t0)

            # 2. no descriptor left: the door cannot accept the connections that come
            door_thread = server._door.thread.native_id
            cpu0, n0, t0 = cpu(door_thread), pushes[0], time.monotonic()
            hog = []
            try:
                while True:
                    hog.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            helper.stdin.write("1\\n")
            helper.stdin.flush()
            helper.stdout.readline()
            time.sleep(3.0)
            for fd in hog:
                os.close(fd)
            out["rate_starved"] = (pushes[0] - n0) / (time.monotonic() - t0)
            out["door_cpu_starved"] = cpu(door_thread) - cpu0
            out["starved_seconds"] = time.monotonic() - t0
            client, out["attach_after"] = timed(sw.attach, name, timeout=30)
            client.close()
            stop.set()
            trainer.join(30)
            mine.close()
            helper.stdin.close()
            helper.wait(30)
            helper.stdout.close()
        out["errors"] = errors
        out["log_lines"] = len(logs)
        out["emfile_lines"] = sum("Too many open files" in m or "accepting" in m for m in logs)
        out["logs"] = logs[:20]
        print(json.dumps(out))

    if __name__ == "__main__":
        main()
    """
)


def _run(args, timeout, env=None):
    """Runs a script in a session of its own; kills all of it if it fails or overstays."""
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out, err = "", f"over {timeout} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
    return p.returncode, out, err


def test_a_flood_of_silent_connections_out_of_file_descriptors(tmp_path):
    """At a low open-file limit, 600 silent connections and then no descriptor left at all:
    an attach still takes seconds, the door neither spins nor floods the log, no thread
    dies, and the worker keeps pushing."""
    (tmp_path / "helper.py").write_text(HELPER)
    (tmp_path / "flooded.py").write_text(FLOODED)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    args = [sys.executable, str(tmp_path / "flooded.py"), str(tmp_path / "helper.py"), _name()]
    code, out, err = _run(args, timeout=150, env=env)
    assert code == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(res, indent=1))  # the measurements, for -s
    assert res["errors"] == []
    assert res["silent_opened"] >= 500
    assert res["attach_in_flood"] < 5
    assert res["attach_after"] < 5
    assert res["emfile_lines"] <= 4, res["logs"]
    assert res["log_lines"] <= 50, res["logs"]
    assert res["door_cpu_starved"] < 0.25 * res["starved_seconds"]
    assert res["rate_flood"] > 0 and res["rate_starved"] > 0
