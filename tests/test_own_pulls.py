"""Read-your-writes without the publish wait (issue #29, item 1).

A loop you own pulls right after it pushes, and the default ``client.pull()``
must hold that push. A busy shard publishes a snapshot only every
``PUBLISH_EVERY``; before this fix the pull waited for that publish (the own
loop ran 17-30% slower). Now a shard answers a turn's pushes after its publish,
so after an idle turn the snapshot holds the push, and a worker whose snapshot
lacks it asks the shard, which serves the pull behind the push at once.

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

    def __init__(self, workers: int, *, busy: bool, consistency=None):
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
    the pull waited for a snapshot that never came (TimeoutError); now the shard serves
    it behind the push: it holds the push, and nothing was published for it."""
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
    assert s.proc.publishes == published  # the shard stayed busy: no publish helped
    assert s.proc.served == client.own_requests == 3  # each pull served behind its push
    assert s.layout.params(s.block)[0] == -3.0


def test_an_idle_shard_publishes_before_it_acks_so_the_pull_reads_the_snapshot(shards):
    """An idle shard publishes at once, and answers the push after that publish, so the
    worker's pull reads the snapshot that holds its push: no request, no served pull."""
    s = shards(1)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert client.own_requests == 0 and s.proc.served == 0


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
