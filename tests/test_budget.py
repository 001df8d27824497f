"""The budget at the client (issue #29): a client given a budget refuses a push past it at
the commit (``sw.BudgetSpent``), in any loop you own (``job.serve`` + ``sw.attach``, not
only ``stalewise run``), and under BSP the round it counts is the shards' round, so a late
joiner stays inside the budget. Real processes attach by name; the rule itself is
``stalewise.protocol.budget``'s."""

from __future__ import annotations

import textwrap
import threading
import time
import uuid

import child_procs
import numpy as np
import pytest

import stalewise as sw
from stalewise.protocol import budget

TIMEOUT = 120  # seconds for a child (a loaded machine)


def test_the_rule_at_commit():
    never = lambda steps: False  # noqa: E731
    assert not budget.refuses(None, False, never, rounds=False)  # no budget: never refused
    assert not budget.refuses(5, True, never, rounds=False)  # granted by may_begin
    assert budget.refuses(5, False, never, rounds=False)
    assert budget.refuses(5, True, never, rounds=True)  # BSP: asked again at the commit
    assert not budget.refuses(5, False, lambda steps: True, rounds=True)
    assert budget.round_of(own=4, shards=2) == 4 and budget.round_of(own=0, shards=7) == 7


# A process you start yourself: attaches by name, given a budget, and pushes without
# asking (``ask``: asks may_begin before each push instead, and is never refused).
GREEDY = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    client = sw.attach(sys.argv[1])
    client.budget = int(sys.argv[2])
    n = 0
    try:
        while sys.argv[3] != "ask" or client.may_begin(client.budget):
            client.pull(timeout=60)
            client.push({"w": np.ones(3, np.float32)})
            n += 1
    except sw.BudgetSpent as e:
        print("refused after", n, e.steps, client.budget_refused, flush=True)
    client.close()
    print("pushed", n, flush=True)
    """
)


def _child(tmp_path, source, *args, stdin=False):
    script = tmp_path / "child.py"
    script.write_text(source)
    return child_procs.start(script, *args, stdin=stdin)


def test_what_every_shard_has_handled_of_an_incarnations_pushes():
    # incarnation 2 committed 5 pushes: a shard of incarnation 2 has handled next_seq of them,
    # a shard a later incarnation joined has handled them all, one still at 1 none
    assert budget.handled(2, 5, [(2, 3), (2, 5)]) == 3
    assert budget.handled(2, 5, [(3, 0), (2, 4)]) == 4
    assert budget.handled(2, 5, [(1, 9), (2, 5)]) == 0
    assert budget.held(12, 5, budget.handled(2, 5, [(1, 9), (2, 5)])) == 7


@pytest.mark.parametrize("consistency", [sw.ASP(), sw.BSP()], ids=["asp", "bsp"])
def test_an_attached_client_given_a_budget_refuses_the_push_past_it(tmp_path, consistency,
                                                                    no_leaks):  # fmt: skip
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0),
                 consistency=consistency)  # fmt: skip
    name = f"test-{uuid.uuid4().hex[:8]}"
    with job.serve(workers=(1, 1), name=name) as server:
        p = _child(tmp_path, GREEDY, name, 7, "greedy")
        try:
            assert child_procs.line(p, TIMEOUT) == ["refused", "after", "7", "7", "1"]
            assert child_procs.line(p, TIMEOUT) == ["pushed", "7"]
            assert p.wait(30) == 0
        finally:
            child_procs.end(p)
        assert server.job_pushes == 7
        np.testing.assert_allclose(server.pull()["w"], -7.0)
        p = _child(tmp_path, GREEDY, name, 9, "ask")  # asks may_begin: never refused
        try:
            assert child_procs.line(p, TIMEOUT) == [
                "pushed",
                "2",
            ]  # 7 of the budget of 9 were spent already
            assert p.wait(30) == 0
        finally:
            child_procs.end(p)
        assert server.job_pushes == 9


# A late BSP joiner: attaches, builds its model (here: until the test says go) while the
# others run rounds, then trains while the budget lets it begin a round.
JOINER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import stalewise as sw

    client = sw.attach(sys.argv[1])
    steps = int(sys.argv[2])
    print("attached", client.worker, flush=True)
    sys.stdin.readline()
    n = 0
    while client.may_begin(steps):
        params = client.pull(timeout=60)
        client.push({"w": np.full(3, 0.01, np.float32)})
        n += 1
    client.close()
    print("pushed", n, flush=True)
    """
)


def _rounds(client, steps, out, attached):
    """A worker's loop in this process: BSP rounds while the budget lets it begin one, a
    step every 10 ms; after 10 rounds it waits until the joiner has ``attached``."""
    n = 0
    try:
        while client.may_begin(steps):
            if n == 10:
                attached.wait(TIMEOUT)
            client.pull(timeout=60)
            client.push({"w": np.full(3, 0.01, np.float32)})
            n += 1
            time.sleep(0.01)
    finally:
        client.close()
        out.append(n)


def test_a_late_bsp_joiner_ends_with_the_shards_rounds_at_the_budget(tmp_path, no_leaks):
    """Two workers run rounds; a third attaches after some and builds its model while
    more run, then joins them. The budget of 400 pushes for the 2 expected workers is
    200 rounds: the shards end at 200 rounds, not 200 plus the rounds the joiner missed
    (its round is the shards', not the clock it attached at plus its pushes)."""
    steps = 400
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0),
                 consistency=sw.BSP())  # fmt: skip
    name = f"test-{uuid.uuid4().hex[:8]}"
    with job.serve(workers=(2, 3), name=name) as server:
        clients = [server.client() for _ in range(2)]
        done: list[int] = []
        attached = threading.Event()
        loops = [threading.Thread(target=_rounds, args=(c, steps, done, attached))
                 for c in clients]  # fmt: skip
        for t in loops:
            t.start()
        p = _child(tmp_path, JOINER, name, steps, stdin=True)
        try:
            assert child_procs.line(p, TIMEOUT) == ["attached", "2"]
            at = _version(server)
            attached.set()
            while _version(server) < at + 20 and all(t.is_alive() for t in loops):
                loops[0].join(0.05)  # 20 rounds while it builds its model
            assert at + 20 <= _version(server) < steps // 2 - 50, _version(server)
            p.stdin.write("go\n")
            p.stdin.flush()
            kind, n = child_procs.line(p, TIMEOUT)
            assert kind == "pushed" and int(n) > 0
            assert p.wait(30) == 0
        finally:
            for t in loops:
                t.join(TIMEOUT)
            child_procs.end(p)
        assert not any(t.is_alive() for t in loops)
        assert [s["version"] for s in server.stats()] == [steps // 2]  # 200 rounds, whole
        assert sorted(done) == [steps // 2] * 2


def _version(server):
    return min(s["version"] for s in server.stats())


def test_on_ray_a_late_joiners_round_is_the_shards_and_its_push_past_the_budget_is_refused(
    ray_cluster,
):
    """The Ray client: a joiner that attached at round 6 and stayed silent while 4 more ran
    counts the shards' round (10, from shard 0's count), not its attach clock plus its
    pushes (6); given a budget, its push into a round past it is refused at the commit
    even after may_begin said yes to a larger one. On the cluster the Ray test files share
    (conftest.py)."""
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0),
                 consistency=sw.BSP())  # fmt: skip
    name = f"test-{uuid.uuid4().hex[:8]}"
    ones = {"w": np.ones(3, np.float32)}
    with job.serve(runtime="ray", workers=(1, 2), name=name) as server:
        first = server.client()
        for _ in range(6):
            first.pull(timeout=60)
            first.push(ones)
        late = sw.attach(name, runtime="ray")
        assert (first.worker, late.worker, late.joined_at) == (0, 1, 6)
        for _ in range(4):  # the late one builds its model: holds no round
            first.pull(timeout=60)
            first.push(ones)
        first.wait(timeout=60)
        assert not late.may_begin(10) and late.may_begin(11)  # round 10
        late.budget = 10
        late.pull(timeout=60)
        with pytest.raises(sw.BudgetSpent):
            late.push(ones)
        assert late.budget_refused == 1 and server.job_pushes == 10
        late.close()
        first.close()
