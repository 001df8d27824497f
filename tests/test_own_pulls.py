"""Read-your-writes without the publish wait (issue #29, item 1).

A loop you own pulls right after it pushes, and the default ``client.pull()``
must hold that push. A busy shard publishes a snapshot only every
``PUBLISH_EVERY``; once the pull waited for that publish (the own loop ran
17-30% slower). Now a shard acks a turn's pushes before it publishes, and the
worker copies its push from the shard's live params (seqlocked), or from the
snapshot a busy shard announced; if steps keep changing the live params as it copies and
no snapshot holds the push, it asks the shard, which serves the pull behind the
push at once. (tests/test_own_live_reads.py races real shard processes.)

These tests run one shard's loop (:class:`ShardProcess`, the body of a shard
process) on a thread of the test process, so that it can be made busy and its
publishing rare, and they assert on what happened (versions, publishes, served
pulls), not on time: the only clock is the timeout a regression would run into.
"""

import os
import threading
import time
from multiprocessing import Pipe

import numpy as np
import pytest

import stalewise as sw
from stalewise.protocol import pipeline
from stalewise.runtime.local import client as client_lib
from stalewise.runtime.local import layout as L
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


def test_a_pull_after_a_push_on_a_busy_shard_reads_the_live_params_without_a_publish(
    shards, monkeypatch
):
    """The shard is busy and publishes rarely (PUBLISH_EVERY of an hour; worker 1 never
    pushes, so the slowest clock never moves, which would publish too). Once the pull
    waited for a snapshot that never came (TimeoutError); now it copies the live params,
    which hold the push: nothing was published or served for it."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)  # read-your-writes
        assert client.pull_has_own
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
        assert client.wait(timeout=TIMEOUT).versions == (step,)  # its acks, read after
    assert s.proc.publishes == published  # the shard stayed busy: no publish helped
    assert s.proc.served == client.own_requests == 0  # no pull asked of the shard
    assert s.layout.params(s.block)[0] == -3.0


def test_a_pull_waits_while_a_step_changes_the_live_params_then_copies_them(shards, monkeypatch):
    """The busy shard's live params are being written when the worker comes to read them
    (the seqlock is odd, as during another worker's step) and no snapshot holds its push:
    the pull copies nothing and asks nothing until the step is over, then reads them."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    client.push({"w": np.ones(N, np.float32)})
    assert client.wait(timeout=TIMEOUT).versions == (1,)
    s.proc.snapshots.changing(0)  # a step under way
    pulled = []
    puller = threading.Thread(target=lambda: pulled.append(client.pull(timeout=TIMEOUT)))
    puller.start()
    puller.join(0.3)
    assert puller.is_alive() and not pulled  # it waits for the step, asking nothing
    assert client.own_requests == 0
    s.proc.snapshots.changed(0, 1)  # the step is over
    puller.join(TIMEOUT)
    np.testing.assert_array_equal(pulled[0]["w"], np.full(N, -1.0, np.float32))
    assert s.proc.served == client.own_requests == 0


def test_a_pull_the_live_params_cannot_give_is_served_behind_the_push(shards, monkeypatch):
    """When copies of the live params keep failing (here: no copy is tried) and no
    snapshot holds the push, the pull asks the shard, which serves it behind the push."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)
    monkeypatch.setattr(client_lib, "LIVE_COPIES", 0)
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    for step in range(1, 3):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert s.proc.publishes == published
    assert s.proc.served == client.own_requests == 2


def test_a_busy_shard_announces_its_publish_and_the_pull_reads_that_snapshot(shards, monkeypatch):
    """A busy shard that publishes after its acks says which version first, so the worker
    waits for that snapshot rather than copy live params the next step is changing."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 0.0)  # a busy shard publishes each turn
    s = shards(2, busy=True)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
        assert s.proc.snapshots.announced(0) == step
    assert s.proc.served == client.own_requests == 0


def test_an_idle_shard_acks_then_publishes_and_the_pull_never_asks(shards):
    """An idle shard acks the push, then publishes at once: the worker's pull reads the
    live params or that snapshot, both holding its push: no request, no served pull."""
    s = shards(1)
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    published = s.proc.publishes
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert client.own_requests == 0 and s.proc.served == 0
    assert s.proc.publishes >= published + 2  # each idle turn published (the last may lag)


def test_own_false_reads_the_snapshot_and_may_miss_the_push(shards, monkeypatch):
    """``pull(own=False)`` neither waits nor asks: on a busy shard that has not published,
    it reads the old snapshot and says so."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)
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
    """Under SSP the snapshot's gate lets the worker read, and it reads its own version
    from the busy shard's live params as under ASP; a pull the gate holds is served."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)
    s = shards(2, busy=True, consistency=sw.SSP(3))
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    for step in range(1, 3):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    assert s.proc.served == client.own_requests == 0


def test_pull_reads_into_fresh_memory_and_last_pull_still_gives_it(shards, monkeypatch):
    """The default pull copies each shard's params once, straight into new memory (not
    through the shared pull buffer, here not even for a served shard); ``last_pull``
    gives the same values afterwards, and no pull's arrays share memory with another's."""
    monkeypatch.setattr(client_lib, "LIVE_COPIES", 0)  # served: through the pull buffer
    s = shards(1)
    client = s.clients[0]
    first = client.pull(timeout=TIMEOUT)
    client.push({"w": np.ones(N, np.float32)})
    second = client.pull(timeout=TIMEOUT)
    shared = (s.layout.params(s.block), client._pull_buf, first["w"])
    assert not any(np.shares_memory(second["w"], a) for a in shared)
    np.testing.assert_array_equal(first["w"], np.zeros(N, np.float32))
    np.testing.assert_array_equal(second["w"], np.full(N, -1.0, np.float32))
    np.testing.assert_array_equal(client.last_pull()["w"], second["w"])


@pytest.mark.parametrize("served", [False, True])
def test_pull_into_a_tree_writes_its_own_arrays_once(shards, monkeypatch, served):
    """``pull(into=tree)`` reads each shard's params straight into the tree's arrays: the
    pull buffer is left alone unless the shard served the pull there; ``last_pull`` gives
    the same values. A leaf it cannot view (not contiguous) takes the copy through the
    pull buffer, and gets the same values."""
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 3600.0)  # busy: the pull reads live or asks
    if served:
        monkeypatch.setattr(client_lib, "LIVE_COPIES", 0)
    s = shards(2, busy=True)  # worker 1 never pushes: the slowest clock stays
    client = s.clients[0]
    client.pull(timeout=TIMEOUT)
    client.push({"w": np.ones(N, np.float32)})
    client._pull_buf[:] = np.nan  # what a copy through the pull buffer would overwrite
    into = {"w": np.full(N, 7.0, np.float32)}
    w = into["w"]
    assert client.pull(into=into, timeout=TIMEOUT) is into and into["w"] is w
    np.testing.assert_array_equal(w, np.full(N, -1.0, np.float32))
    assert (np.isnan(client._pull_buf).all(), client.own_requests) == (not served, served)
    np.testing.assert_array_equal(client.last_pull()["w"], w)
    strided = {"w": np.zeros(2 * N, np.float32)[::2]}
    client.pull(into=strided, timeout=TIMEOUT)
    np.testing.assert_array_equal(strided["w"], w)


def test_pull_into_numpy_and_torch_leaves_across_shards(no_leaks):
    """Leaves that straddle the shards' ranges, NumPy arrays and a torch module's tensors,
    get what a fresh pull gives, in their own memory, not through the pull buffer."""
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 7))
    tree = {"a": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)}
    for params in (tree, model):
        job = sw.Job(params, optimizer=sw.optim.sgd(1.0), shards=3)
        with job.serve(workers=1) as server:
            client = server.client(0)
            size = client.pull_flat(timeout=TIMEOUT).size
            grads = sw.tree.unflatten(np.arange(size, dtype=np.float32), client.spec)
            client.push(grads)  # a distinct value in every element
            expected = client.pull(timeout=TIMEOUT)
            client._pull_buf[:] = np.nan
            leaves = dict(model.state_dict(keep_vars=True)) if params is model else dict(tree)
            ptrs = {k: v.data_ptr() for k, v in leaves.items()} if params is model else None
            client.pull(into=params, timeout=TIMEOUT)
            for k, v in leaves.items():
                got = v.detach().numpy() if params is model else v
                np.testing.assert_array_equal(got, np.asarray(expected[k]), err_msg=k)
                assert ptrs is None or v.data_ptr() == ptrs[k]
            assert (client.own_requests, np.isnan(client._pull_buf).all()) == (0, True)
            if params is model:  # autograd sees the write, as it saw copy_() before
                y = model(torch.ones(1, 5, requires_grad=True)).sum()
                client.pull(into=model, timeout=TIMEOUT)
                with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                    y.backward()
            client.close()


def test_a_pull_reuses_the_memory_of_an_earlier_pull_once_nothing_refers_to_it(shards):
    """Fresh arrays come from one of the last two pulls' memory once the caller dropped
    every array of it (no page faults), never from memory still referred to: a kept leaf,
    a torch tensor made from one, or the tree in ``params = client.pull()`` is not
    overwritten by the pulls after it."""
    torch = pytest.importorskip("torch")
    s = shards(1)
    client = s.clients[0]
    address = client.pull(timeout=TIMEOUT)["w"].__array_interface__["data"][0]
    again = client.pull(timeout=TIMEOUT)["w"]  # the first tree is gone: its memory again
    assert again.__array_interface__["data"][0] == address
    kept, tensor = again, torch.from_numpy(client.pull(timeout=TIMEOUT)["w"])
    params = client.pull(timeout=TIMEOUT)
    for step in range(1, 4):
        client.push({"w": np.ones(N, np.float32)})
        params = client.pull(timeout=TIMEOUT)  # the tree from two pulls ago is free
        np.testing.assert_array_equal(params["w"], np.full(N, -float(step), np.float32))
    np.testing.assert_array_equal(kept, np.zeros(N, np.float32))
    np.testing.assert_array_equal(tensor.numpy(), np.zeros(N, np.float32))
    assert len({id(a) for a in client._spares}) == 2  # two held, no more made than that


def test_a_step_waits_while_a_worker_copies_the_live_params(shards, monkeypatch):
    """A worker copying the live params marks it in the table; the shard's next step waits
    for that copy (it would tear it), here until the mark goes (no bound in sight)."""
    monkeypatch.setattr(pipeline, "READ_WAIT", 1e9)
    s = shards(2)
    client, row = s.clients[0], s.proc.snapshots.table[0]
    client.push({"w": np.ones(N, np.float32)})  # the first step compiles the optimizer
    client.pull(timeout=TIMEOUT)
    assert not row[L._READING :].any()  # the pull's own marks are gone
    row[L._READING + 1] = time.monotonic_ns()  # worker 1 began to copy
    client.push({"w": np.ones(N, np.float32)})
    with pytest.raises(TimeoutError):
        client.wait(timeout=0.5)
    assert s.proc.shard.version == 1  # the step waits
    row[L._READING + 1] = 0  # the copy is over
    assert client.wait(timeout=TIMEOUT).versions == (2,)


def test_a_mark_left_by_a_worker_that_died_copying_holds_a_step_back_no_longer_than_the_bound(
    shards,
):
    s = shards(2)
    client, row = s.clients[0], s.proc.snapshots.table[0]
    client.push({"w": np.ones(N, np.float32)})  # the first step compiles the optimizer
    client.pull(timeout=TIMEOUT)
    s.proc.copy_time = 0.01
    row[L._READING + 1] = time.monotonic_ns() - 10**9  # a second ago, past READ_WAIT copies
    client.push({"w": np.ones(N, np.float32)})
    assert client.wait(timeout=0.5).versions == (2,)  # no wait for the dead worker's copy
    assert (
        0
        < pipeline.step_wait([time.monotonic()], time.monotonic(), 0.01)
        <= 0.01 * pipeline.READ_WAIT
    )
