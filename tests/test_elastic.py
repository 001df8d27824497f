"""Elastic membership: worker ids that join a running job, leave it, and attach by name."""

import os
import queue
import signal
import textwrap
import threading
import time
import uuid

import child_procs
import numpy as np
import pytest

import stalewise as sw
from stalewise import optim, segments
from stalewise.consistency import BSP, SSP
from stalewise.protocol import PushHeader, Shard


def _shard(workers, expected, consistency):
    params = np.zeros(2, np.float32)
    seg = segments.Segments.single(2)
    return Shard(
        params, seg, optim.sgd(1.0), workers=workers, expected=expected, consistency=consistency
    )


def _push(shard, w, seq, inc=1, value=1.0):
    header = PushHeader(worker=w, seq=seq, base_version=shard.version, incarnation=inc)
    return shard.push(header, np.full(2, value, np.float32))


def test_bsp_rounds_are_taken_over_the_workers_live_now():
    shard = _shard(workers=3, expected=1, consistency=BSP())
    shard.join(0, 1)
    assert _push(shard, 0, 0).ok and shard.version == 1  # alone: its round closes at once
    shard.join(2, 1)  # an id nobody expected joins
    shard.pull(2)  # and starts: it counts for the rounds from here
    assert _push(shard, 0, 1).ok and shard.version == 1  # the round now waits for worker 2
    assert _push(shard, 2, 0, value=3.0).ok and shard.version == 2
    assert shard.params.tolist() == [-3.0, -3.0]  # 1 + mean(1, 3)
    assert _push(shard, 0, 2).ok and shard.version == 2
    shard.leave(2)  # it leaves: the round it owed closes without it
    assert shard.version == 3


def test_an_expected_worker_joining_late_takes_its_seat_in_the_round_under_way():
    shard = _shard(workers=2, expected=2, consistency=BSP())
    shard.join(0, 1)
    assert _push(shard, 0, 0).ok and shard.version == 0  # the round waits for worker 1
    shard.join(1, 1)  # its first incarnation, after worker 0 pushed: the round still waits
    assert shard.version == 0 and shard.counted[1] and int(shard.clocks[1]) == 0
    assert _push(shard, 1, 0, value=3.0).ok and shard.version == 1
    assert shard.params.tolist() == [-2.0, -2.0]  # mean(1, 3): both in the first round
    shard.join(1, 2)  # a restart is not a first incarnation: the round it owed closes
    assert _push(shard, 0, 1).ok and shard.version == 2


def test_ssp_bounds_count_only_the_live_workers():
    shard = _shard(workers=2, expected=1, consistency=SSP(1))
    shard.join(0, 1)
    for seq in range(3):  # alone, worker 0 is never ahead of anyone
        assert shard.may_start(0)
        _push(shard, 0, seq)
    shard.join(1, 1)  # joins at the slowest live clock: it holds no one back
    assert shard.may_start(0) and shard.may_start(1)
    shard.pull(1)  # it counts for the bound from its first pull
    _push(shard, 0, 3)
    _push(shard, 0, 4)
    assert not shard.may_start(0)  # now two ahead of worker 1


def test_a_joiner_counts_for_the_rounds_from_its_first_pull_not_its_join():
    shard = _shard(workers=3, expected=2, consistency=BSP())
    shard.join(0, 1)
    shard.join(1, 1)
    for seq in range(2):  # two rounds of the expected workers
        assert _push(shard, 0, seq).ok and _push(shard, 1, seq).ok
    assert shard.version == 2
    shard.join(2, 1)  # attaches, then builds its model: it holds no round meanwhile
    assert shard.live[2] and not shard.counted[2] and shard.min_clock() == 2
    for seq in range(2, 5):
        assert _push(shard, 0, seq).ok and _push(shard, 1, seq).ok
    assert shard.version == 5  # three more rounds while the joiner was silent
    assert shard.may_start(2)  # it may start at once, at the slowest clock
    shard.pull(2)  # its first pull: from now on it is in the rounds
    assert shard.counted[2] and int(shard.clocks[2]) == 5 and shard.min_clock() == 5
    assert _push(shard, 0, 5).ok and _push(shard, 1, 5).ok
    assert shard.version == 5  # the round waits for the joiner
    assert not shard.may_start(0)
    assert _push(shard, 2, 0, value=4.0).ok and shard.version == 6
    assert shard.params.tolist() == [-7.0, -7.0]  # 5 rounds of 1, then mean(1, 1, 4)


def test_a_late_joiner_left_alone_is_not_held_by_a_floor_of_zero():
    """When every counted worker has left, the gates' floor is the slowest live clock,
    not 0, or an SSP bound would hold the late joiner left alone forever."""
    shard = _shard(workers=3, expected=2, consistency=SSP(2))
    for w in range(2):
        shard.join(w, 1)
    for seq in range(5):
        assert _push(shard, 0, seq).ok and _push(shard, 1, seq).ok
    shard.join(2, 1)  # a late joiner, not counted yet, at clock 5
    shard.leave(0)
    shard.leave(1)
    assert not shard.counted.any() and shard.min_clock() == 5
    assert shard.may_start(2)
    shard.pull(2)
    assert shard.counted[2] and shard.min_clock() == 5


def test_a_restart_counts_from_its_first_pull_and_a_pending_joiner_survives_a_checkpoint():
    shard = _shard(workers=4, expected=3, consistency=BSP())
    for w in range(3):
        shard.join(w, 1)
        assert shard.counted[w]  # a first incarnation at clock 0 counts from its join
    for w in range(3):
        assert _push(shard, w, 0).ok
    assert shard.version == 1
    shard.join(0, 2)  # worker 0 restarts: not in the rounds until its first pull or push
    assert not shard.counted[0] and int(shard.clocks[0]) == 1
    shard.pull(0)  # its budget counts the shards' round, so it starts in the one under way
    assert shard.counted[0] and int(shard.clocks[0]) == 1
    shard.join(3, 1)  # a late joiner: not in the rounds until its first pull or push
    assert not shard.counted[3]
    state = shard.state_dict()
    assert state["counted"].tolist() == [True, True, True, False]
    restored = _shard(workers=4, expected=3, consistency=BSP())
    restored.load_state_dict(state)
    for s in (shard, restored):
        assert _push(s, 1, 1).ok and _push(s, 2, 1).ok and s.version == 1  # waits for 0
        assert _push(s, 0, 0, inc=2).ok and s.version == 2  # not held by worker 3
        assert _push(s, 3, 0).ok  # its first push (no pull): in the round under way
        assert s.counted[3] and s.version == 2
        assert _push(s, 0, 1, inc=2).ok and _push(s, 1, 2).ok and _push(s, 2, 2).ok
        assert s.version == 3
    assert "counted" not in shard.state_dict()  # every live worker counts again
    assert restored.params.tolist() == shard.params.tolist()


def test_expected_is_checked():
    with pytest.raises(ValueError, match=r"expected must be 0\.\.2"):
        _shard(workers=2, expected=3, consistency=BSP())


@pytest.mark.parametrize("workers", [0, (3, 2), (-1, 2), (1, 2, 3), "4", (1.5, 2), (True, 2)])
def test_bad_worker_ranges_are_named(workers):
    job = sw.Job({"w": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with pytest.raises(ValueError, match="workers must be"):
        job.serve(workers=workers)


# -- attaching processes (real ones, started here as a user would) ---------------------

CHILD = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import stalewise as sw

    client = sw.attach(sys.argv[1])
    print("worker", client.worker, client.incarnation, flush=True)
    for _ in range(int(sys.argv[2])):
        params = client.pull()
        client.push({"w": np.ones_like(params["w"])})
    client.wait()
    print("pushed", flush=True)
    if sys.argv[3] == "hang":
        time.sleep(60)
    """
)


@pytest.fixture
def child(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    started = []

    def start(name, pushes, then="exit"):
        started.append(child_procs.start(script, name, pushes, then))
        return started[-1]

    yield start
    for p in started:
        child_procs.end(p)


def _name():
    return f"test-{uuid.uuid4().hex[:8]}"


def test_a_process_you_start_attaches_by_name_and_its_id_is_free_once_it_ends(child, no_leaks):
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))
    name = _name()
    with job.serve(workers=(0, 2), name=name) as server:
        first = child(name, 5)
        assert child_procs.line(first) == ["worker", "0", "1"]
        assert child_procs.line(first) == ["pushed"]
        assert first.wait(30) == 0
        np.testing.assert_allclose(server.pull()["w"], -5.0)
        again = child(name, 2)  # worker 0 has gone: its id is free again
        assert child_procs.line(again) == ["worker", "0", "2"]
        assert child_procs.line(again) == ["pushed"]
        assert again.wait(30) == 0
        np.testing.assert_allclose(server.pull()["w"], -7.0)


def test_a_killed_attached_worker_stops_holding_back_a_bsp_round(child, no_leaks):
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    name = _name()
    with job.serve(workers=(0, 3), name=name) as server:
        idle = child(name, 1, "hang")  # pushes once (a round of its own), then idles
        assert child_procs.line(idle) == ["worker", "0", "1"]
        assert child_procs.line(idle) == ["pushed"]
        assert server.attached() == {0}
        mine = server.client()  # a worker joins the running job from this process: id 1
        assert mine.worker == 1
        mine.pull(timeout=10)
        mine.push({"w": np.ones(3, np.float32)})
        with pytest.raises(TimeoutError):  # the round waits for the idle worker
            mine.pull(timeout=2)
        idle.send_signal(signal.SIGKILL)
        idle.wait(10)
        params = mine.pull(timeout=30)  # its death closes the round without it
        np.testing.assert_allclose(params["w"], -2.0)
        deadline = time.monotonic() + 10
        while server.attached() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.attached() == set()
        mine.close()


def test_attach_errors_are_one_line(child):
    with pytest.raises(sw.AttachError, match="no job named 'nobody-here'"):
        sw.attach("nobody-here")
    with pytest.raises(ValueError, match="job name 'a b'"):
        sw.attach("a b")
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))
    name = _name()
    with job.serve(workers=1, name=name):
        with pytest.raises(ValueError, match="already served"):
            job.serve(workers=1, name=name)
        first = child(name, 1, "hang")
        assert child_procs.line(first)[0] == "worker"
        with pytest.raises(sw.AttachError, match="the job is full"):
            sw.attach(name, timeout=10)
        with pytest.raises(sw.AttachError, match="worker 0 is held by an attached process"):
            sw.attach(name, worker=0, timeout=10)
    assert not os.path.exists(sw.runtime.local.attach.door_dir() / f"{name}.key")


def _within(seconds, call, *args, **kwargs):
    """``call(*args, **kwargs)`` on a thread, failing the test if it takes over ``seconds``."""
    out = queue.Queue()

    def run():
        try:
            out.put((True, call(*args, **kwargs)))
        except BaseException as e:  # handed to the test
            out.put((False, e))

    threading.Thread(target=run, daemon=True).start()
    try:
        ok, value = out.get(timeout=seconds)
    except queue.Empty:
        pytest.fail(f"{getattr(call, '__name__', call)} took over {seconds} s")
    if not ok:
        raise value
    return value


def test_a_silent_attacher_delays_no_server_call_and_no_other_attach(no_leaks):
    """A process that connects to the door and never finishes its handshake, at any step,
    holds neither the server's lock nor the door: others attach and calls return at once."""
    import socket
    from multiprocessing import connection

    from stalewise.runtime.local import attach as attach_mod

    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))
    name = _name()
    sock, keyfile = attach_mod._paths(name)
    silent = []
    with job.serve(workers=(0, 4), name=name) as server:
        try:
            raw = socket.socket(socket.AF_UNIX)
            silent.append(raw)
            raw.connect(str(sock))  # connects, then never says a word
            first = _within(5, sw.attach, name, timeout=20)
            assert first.worker == 0
            # the next authenticates and asks for a worker, then never takes its pipes
            key = keyfile.read_bytes()
            asks = _within(5, connection.Client, str(sock), family="AF_UNIX", authkey=key)
            silent.append(asks)
            asks.send_bytes(b'{"worker": null, "pid": %d}' % os.getpid())
            assert asks.poll(10)  # the door has made its client (worker 1) and sent it
            mine = _within(3, server.client)  # and the server's lock is free meanwhile
            assert mine.worker == 2  # worker 1 is not handed out twice
            _within(3, server.stats, timeout=5)
            _within(3, server.pull, timeout=5)
            other = _within(5, sw.attach, name, timeout=20)
            assert other.worker == 3
            assert server.attached() == {0, 3}
            for c in (first, other, mine):
                c.close()
        finally:
            for s in silent:
                s.close()


def test_a_silent_attacher_is_cut_off_after_the_handshake_timeout(monkeypatch, no_leaks):
    import socket

    from stalewise.runtime.local import attach as attach_mod

    monkeypatch.setattr(attach_mod, "HANDSHAKE_TIMEOUT", 1.0)
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))
    name = _name()
    with job.serve(workers=(0, 2), name=name):
        raw = socket.socket(socket.AF_UNIX)
        try:
            raw.connect(str(attach_mod._paths(name)[0]))
            raw.settimeout(20)
            t0 = time.monotonic()
            while raw.recv(4096):  # the door's challenge, then the end of the socket
                pass
            assert time.monotonic() - t0 < 10
        finally:
            raw.close()


JOINER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    client = sw.attach(sys.argv[1])
    print("worker", client.worker, client.incarnation, flush=True)
    sys.stdin.readline()  # builds its model (here: until the test says go)
    params = client.pull(timeout=60)
    print("pulled", flush=True)
    sys.stdin.readline()
    for _ in range(3):
        client.push({"w": np.ones_like(params["w"])})
        params = client.pull(timeout=60)
    print("pushed", flush=True)
    client.close()
    """
)


def _version(server):
    return min(s["version"] for s in server.stats())


def _rounds(client, stop):
    """A worker's loop: pull, push, in BSP rounds, until ``stop`` is set."""
    while not stop.is_set():
        try:
            params = client.pull(timeout=0.5)
        except TimeoutError:  # the round waits (for the joiner, once it is in)
            continue
        client.push({"w": np.full_like(params["w"], 0.01)})


def test_an_attached_joiner_holds_no_bsp_round_until_its_first_pull(tmp_path, no_leaks):
    script = tmp_path / "joiner.py"
    script.write_text(JOINER)
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0), consistency=sw.BSP())
    name = _name()
    with job.serve(workers=(2, 3), name=name) as server:
        clients = [server.client() for _ in range(2)]
        stop = threading.Event()
        loops = [threading.Thread(target=_rounds, args=(c, stop), daemon=True) for c in clients]
        for t in loops:
            t.start()
        p = child_procs.start(script, name, stdin=True)
        try:
            assert child_procs.line(p) == ["worker", "2", "1"]
            attached = _version(server)
            deadline = time.monotonic() + 30  # on a loaded machine; rounds take ms
            while _version(server) < attached + 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            # ten rounds of the two others while the joiner was attached and silent
            assert _version(server) >= attached + 10
            assert server.attached() == {2}
            p.stdin.write("go\n")
            p.stdin.flush()
            assert child_procs.line(p) == ["pulled"]
            in_rounds = _version(server)
            time.sleep(1.0)
            assert _version(server) == in_rounds  # after its first pull the rounds wait for it
            p.stdin.write("go\n")
            p.stdin.flush()
            assert child_procs.line(p) == ["pushed"]
            assert _version(server) >= in_rounds + 3  # its three pushes, three rounds
            assert p.wait(30) == 0
        finally:
            stop.set()
            for t in loops:
                t.join(10)
            for c in clients:
                c.close()
            child_procs.end(p)
