"""Read-your-writes without the publish wait (issue #29, item 1).

A loop you own pulls right after it pushes, and the default ``client.pull()``
must hold that push. A busy shard publishes a snapshot only every
``PUBLISH_EVERY``; a pull that waited for that publish made the own loop 17-30%
slower. Now a pull whose push is not acknowledged yet asks each shard at once,
behind the push on the same pipe, and the shard serves it in the turn that
applies the push, replying before it publishes; a pull after the ack reads a
snapshot that holds the push (an idle shard publishes before it acks), and asks
a shard whose snapshot does not.

These tests run one shard's loop (:class:`ShardProcess`, the body of a shard
process) on a thread of the test process, so that it can be made busy and its
publishing rare, and they assert on what happened (versions, publishes, served
pulls), not on time: the only clock is the timeout a regression would run into.
"""

import os
import threading
from multiprocessing import Pipe

import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.local import shard_proc
from stalewise.runtime.local.client import Client
from stalewise.runtime.local.layout import Layout
from stalewise.runtime.local.shard_proc import ShardProcess
from stalewise.runtime.local.shm import SharedBlock

N = 1000
TIMEOUT = 20.0  # seconds: only a regression waits this long (a missing publish)


class ShardThread:
    """Shard 0 of a one-shard job, its loop on a thread, and a client per worker."""

    def __init__(self, workers: int, *, busy: bool, consistency=None, run: bool = True):
        job = sw.Job(
            {"w": np.zeros(N, np.float32)},
            optimizer=sw.optim.sgd(1.0),
            **({} if consistency is None else {"consistency": consistency}),
        )
        config = job.config
        self.layout = layout = Layout.of(config, workers, workers)
        self.block = SharedBlock.create(layout.nbytes)
        layout.params(self.block)[:] = config.init
        layout.control(self.block)[layout.shard_exits] = np.nan  # the shard runs
        self._control, theirs = Pipe()
        self.proc = ShardProcess(config, 0, self.block, layout, theirs)
        if busy:  # as if another worker's message always waited: publish every PUBLISH_EVERY
            self.proc.busy = lambda: True
        self.proc.publish_now()
        self.clients = []
        for w in range(workers):
            mine, shards = Pipe()
            self.proc.admit(os.dup(shards.fileno()), w, 1)
            shards.close()
            self.clients.append(Client(w, self.block.handle, layout, config, [mine], incarnation=1))
        self._stop = threading.Event()
        self._error: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        if run:
            self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.proc.turn(0.01)
                self.proc.settle()
        except BaseException as e:  # reported by close()
            self._error.append(e)

    def close(self) -> None:
        for c in self.clients:
            c.close()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        for p in list(self.proc.pipes):
            p.close()
        self._control.close()
        self.proc.control.close()
        del self.proc
        self.block.unlink()
        self.block.close()
        assert not self._error, self._error


@pytest.fixture
def shards(monkeypatch):
    made = []

    def make(workers=2, *, busy=False, **kw):
        made.append(ShardThread(workers, busy=busy, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_pull_after_a_push_on_a_busy_shard_is_served_without_waiting_for_a_publish(
    shards, monkeypatch
):
    """The shard is busy and publishes rarely (PUBLISH_EVERY of an hour; worker 1 never
    pushes, so the slowest clock never moves, which would publish too). Before the fix
    the pull waited for a snapshot that never came (TimeoutError); now the shard answers
    it behind the push, publishing for it at once (a busy shard answers by its snapshot,
    which the worker copies, rather than copy into each pull buffer)."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)  # read-your-writes
        assert client.pull_has_own
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
        assert client.last_result.versions == (step,)
    # each pull answered behind its push: by a publish made for it, the shard being busy
    assert s.proc.published_answers == client.own_requests == 3
    assert s.proc.publishes == published + 3 and s.proc.served == 0
    assert s.layout.params(s.block)[0] == -3.0


def test_an_idle_shard_publishes_before_it_acks_so_a_pull_after_the_ack_reads_the_snapshot(
    shards,
):
    """An idle shard that serves no pull publishes at once and acks after that publish,
    so a pull after the ack reads the snapshot that holds the push: no request."""
    s = shards(1)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        assert client.wait(timeout=TIMEOUT).versions == (step,)
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert client.own_requests == 0 and s.proc.served == 0


def test_a_pull_right_after_a_push_asks_before_the_ack_and_is_answered_before_the_publish(
    shards, monkeypatch
):
    """The pull does not wait for the push's ack to ask: its request is in the pipe
    behind the push before the shard has run at all (before the fix it waited for the
    ack, and asked only once a busy shard's snapshot lacked the push). The shard
    handles both in one turn, and sends the ack and the served pull before it
    publishes, if it does (as a busy turn, at most every PUBLISH_EVERY): the worker
    waits for no copy into the snapshot."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)  # no publish due: a copy
    s = shards(1, run=False)  # the test turns the shard's loop itself
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)  # the snapshot published at start
    order = []
    for name in ("answer", "publish_now"):
        method = getattr(s.proc, name)
        setattr(s.proc, name, lambda *a, m=method, n=name: (order.append(n), m(*a))[1])
    client.push({"w": np.ones(N, np.float32)})
    with pytest.raises(TimeoutError):
        client.pull(timeout=0.01)  # the shard does not run: no ack
    assert client.own_requests == 1  # asked, behind the push
    s.proc.turn(TIMEOUT)
    s.proc.settle()
    assert s.proc.served == 1 and order[0] == "answer"  # then perhaps publish_now
    params = client.pull(timeout=TIMEOUT)
    assert client.pull_has_own and client.last_result.versions == (1,)
    np.testing.assert_array_equal(params["w"], np.full(N, -1.0, np.float32))
    assert client.own_requests == 1  # the request of the timed-out pull was answered


def test_an_ack_waits_for_the_pull_asked_behind_its_push(shards, monkeypatch):
    """The shard read the push alone, and the pull's request arrived during the apply:
    the ack waits for the next turn and goes out with the pull's answer, so the worker
    wakes up once for both (before, the ack went out alone)."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)
    s = shards(1, run=False)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    client.push({"w": np.ones(N, np.float32)})
    s.proc.turn(TIMEOUT)  # the push alone
    with pytest.raises(TimeoutError):
        client.pull(timeout=0.01)  # asks behind the push; no answer yet
    s.proc.settle()
    assert not client._conns[0].poll(0)  # the ack is held: the request waits in the pipe
    s.proc.turn(TIMEOUT)
    s.proc.settle()
    assert client._conns[0].poll(0) and s.proc.served + s.proc.published_answers == 1
    params = client.pull(timeout=TIMEOUT)
    assert client.pull_has_own and client.last_result.versions == (1,)
    np.testing.assert_array_equal(params["w"], np.full(N, -1.0, np.float32))


def _push_and_ask(client) -> None:
    """A push, then a pull that asks behind it and gives up (the shard has not run)."""
    client.push({"w": np.ones(N, np.float32)})
    with pytest.raises(TimeoutError):
        client.pull(timeout=0.01)


def test_when_a_publish_is_due_the_pull_is_answered_by_the_snapshot(shards, monkeypatch):
    """A publish due anyway (here PUBLISH_EVERY is 0) answers the waiting pull: the shard
    publishes once and replies ``published``, copying nothing into the pull buffer, and
    the worker reads the snapshot, which holds its push."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 0.0)
    s = shards(1, run=False)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    _push_and_ask(client)
    s.proc.turn(TIMEOUT)
    s.proc.settle()
    assert (s.proc.served, s.proc.published_answers, s.proc.publishes) == (0, 1, published + 1)
    params = client.pull(timeout=TIMEOUT)
    assert client.pull_has_own and client.last_result.versions == (1,)
    np.testing.assert_array_equal(params["w"], np.full(N, -1.0, np.float32))


def test_pulls_waiting_together_are_answered_by_one_publish(shards, monkeypatch):
    """Two workers' pulls wait behind their pushes in one turn: one publish answers both
    (no copy per worker on the shard), though no publish was due by time."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)
    s = shards(2, run=False)
    for c in s.clients:
        c.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    for c in s.clients:
        _push_and_ask(c)
    while len(s.proc.waiting) + s.proc.published_answers < 2:  # both pipes read
        s.proc.turn(TIMEOUT)
    s.proc.settle()
    assert (s.proc.served, s.proc.published_answers, s.proc.publishes) == (0, 2, published + 1)
    for c in s.clients:
        np.testing.assert_array_equal(c.pull(timeout=TIMEOUT)["w"], np.full(N, -2.0, np.float32))
        assert c.pull_has_own


def test_own_false_reads_the_snapshot_and_may_miss_the_push(shards, monkeypatch):
    """``pull(own=False)`` neither waits nor asks: on a busy shard that has not published,
    it reads the old snapshot and says so."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    client.push({"w": np.ones(N, np.float32)})
    params = client.pull(own=False, timeout=TIMEOUT)
    assert not client.pull_has_own
    np.testing.assert_array_equal(params["w"], np.zeros(N, np.float32))
    assert client.own_requests == 0 and s.proc.served == 0
    assert client.wait(timeout=TIMEOUT).status == "applied"


def test_ssp_read_your_writes_on_a_busy_shard(shards, monkeypatch):
    """Under SSP the snapshot's gate lets the worker read, and the busy shard serves its
    own version as under ASP; the served pull is gated by the shard as any."""
    monkeypatch.setattr(shard_proc, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True, consistency=sw.SSP(3))
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    for step in range(1, 3):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert s.proc.served == 2
