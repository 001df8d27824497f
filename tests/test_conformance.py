"""Conformance: the runtimes end in the same shard states.

One scripted job runs in the simulator, whose fixed step times fix the order of
every pull and push; the trace of that order is then replayed through the local
runtime's real shard processes and clients (a worker's pull may overtake its own
push in flight, as the pipelining rule of :mod:`stalewise.protocol.pipeline`
allows: the replay computes each push from the pull it followed). The protocol (the commit rule,
staleness, clocks, sequence numbers, incarnations, the optimizer) must leave the
very same bits in both, including refused pushes (a NaN in one shard's slice,
a push too stale).

Then one job whose schedule is fixed by the protocol itself (BSP with one worker:
every pull holds the worker's last push) is trained by ``Job.train`` in all three
runtimes, the simulator, local processes and Ray, with and without a lossy codec
(error feedback, decode-back for the verdict with two shards): the same number
of pushes (the budget rule) and the same final parameters.
"""

import itertools
import math
import sys
import time

import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.engine import Simulation
from stalewise.runtime.sim.models import Fixed, Network, Service, WorkerTiming

STEP = {0: 1.0, 1: 1.7}  # virtual seconds per step of each worker: no two events tie
N = 6  # elements per leaf; with 2 shards, leaf "a" is on shard 0 and "b" on shard 1


def scripted_grads(params, batch):
    """A deterministic update from the pulled params; worker 1's 2nd push has a NaN in "b"."""
    w, k = batch
    a, b = params["a"], params["b"]
    ga = ((a - (w + 1.0)) * np.float32(0.5) + np.float32(0.01 * k)).astype(np.float32)
    gb = (b * np.float32(0.25) - np.float32(1.0 + w)).astype(np.float32)
    if (w, k) == (1, 1):
        gb[1] = np.nan
    return float(np.abs(ga).sum()), {"a": ga, "b": gb}


def scripted_data(worker, workers):
    return ((worker, k) for k in itertools.count())


CASES = {
    "asp-constant": dict(consistency=sw.ASP(), staleness=sw.staleness.constant()),
    "asp-inverse-max1-dc": dict(
        consistency=sw.ASP(), staleness=sw.staleness.inverse(max_staleness=1, dc_lambda=0.1)
    ),
    "ssp1-polynomial": dict(consistency=sw.SSP(1), staleness=sw.staleness.polynomial(0.5)),
    "bsp": dict(consistency=sw.BSP(), staleness=sw.staleness.constant()),
}


def make_job(case):
    params = {"a": np.linspace(-1, 1, N, dtype=np.float32), "b": np.ones(N, np.float32)}
    return sw.Job(params, optimizer=sw.optim.adam(0.05), shards=2, **CASES[case])


def run_sim(job, steps):
    """Runs the job in the simulator; returns the shards' states and the order of events.

    The order is what each shard handled, in turn: ``("pull", w)`` and
    ``("push", w, seq)`` (the push of worker ``w``'s step ``seq``).
    """
    cfg = SimConfig(
        compute=Fixed(1.0),
        network=Network(latency=1e-6, bandwidth=math.inf),
        service=Service(0, math.inf),
    )
    timing = WorkerTiming(cfg, 2, factors=[STEP[0], STEP[1]], delays=[0.0, 0.0], seed=0)
    fns = (scripted_grads, scripted_data, job.strategy)
    sim = Simulation(job.config, fns, 2, steps, cfg, timing)
    orders = [[], []]
    for shard, order in zip(sim.shards, orders, strict=True):
        pull, push = shard.pull, shard.push

        def logged_pull(worker=None, out=None, *, now=None, pull=pull, order=order):
            if worker is not None:
                order.append(("pull", worker))
            return pull(worker, out, now=now)

        def logged_push(header, payload, *, verdict=None, now=None, push=push, order=order):
            order.append(("push", header.worker, header.seq))
            return push(header, payload, verdict=verdict, now=now)

        shard.pull, shard.push = logged_pull, logged_push
    sim.run(lambda: False, 1e9, math.inf)
    # the budget rule: exact in the simulator; under BSP, whole rounds of the 2 workers
    assert sim.pushes == (
        2 * math.ceil(steps / 2) if job.config.consistency.averages_rounds else steps
    )
    assert orders[0] == orders[1], "the shards handled the script in different orders"
    return [s.state_dict() for s in sim.shards], orders[0]


def replay_locally(job, order):
    """Replays the simulator's order of pulls and pushes through real shard processes."""
    with job.serve(workers=2) as server:
        clients = [server.client(0), server.client(1)]
        # a worker's pushes are pipelined: its next pull may come before the shards handle
        # its push, so push `seq` is computed from that worker's pull number `seq`, against
        # the versions that pull got (the sender's bases then, as the simulator's commit had)
        pulled, bases = [[], []], [[], []]
        for event in order:
            w = event[1]
            c = clients[w]
            if event[0] == "pull":
                # wait until every shard published what it applied, as the simulator's
                # pulls (served by the shard) see it
                versions = [s["version"] for s in server.stats()]
                c._attach()
                deadline = time.monotonic() + 10
                while any(c._snapshots.version(j) < v for j, v in enumerate(versions)):
                    assert time.monotonic() < deadline
                    time.sleep(0.001)
                pulled[w].append(c.pull(timeout=10))
                bases[w].append(list(c._sender.bases))
            else:
                _, grads = scripted_grads(pulled[w][event[2]], (w, event[2]))
                c._sender.bases[:] = bases[w][event[2]]
                c.push(grads)
                c.wait(timeout=10)
        for c in clients:
            c.close()
        deadline = time.monotonic() + 10
        while (states := server.state_dicts())[0]["live"].any() or states[1]["live"].any():
            assert time.monotonic() < deadline, "the shards did not see the workers leave"
            time.sleep(0.01)
        return states


@pytest.mark.parametrize("case", list(CASES))
def test_simulator_and_local_runtime_end_bit_identical(case, no_leaks):
    steps = 9
    sim_states, order = run_sim(make_job(case), steps)
    local_states = replay_locally(make_job(case), order)
    rejected = sim_states[0]["stats.rejected"]
    assert rejected.get("not_finite") == 1  # the script's NaN was refused by both shards
    if case == "asp-inverse-max1-dc":
        assert rejected.get("too_stale", 0) >= 1  # and some pushes were too stale
    skip = set() if "dc" in case else {"stats.bytes_out"}  # only served pulls count bytes out
    for k, (mine, theirs) in enumerate(zip(sim_states, local_states, strict=True)):
        assert mine.keys() == theirs.keys()
        for key in mine.keys() - skip:
            a, b = mine[key], theirs[key]
            if isinstance(a, np.ndarray):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), f"shard {k} {key}"
            else:
                assert a == b, f"shard {k} {key}: sim {a!r}, local {b!r}"
    assert sim_states[0]["version"] == sim_states[1]["version"] > 0


def test_the_trace_really_interleaves_the_workers():
    """The script is only a conformance test if pushes overlap (staleness > 0)."""
    states, order = run_sim(make_job("asp-constant"), 9)
    assert {e[1] for e in order if e[0] == "push"} == {0, 1}
    assert any(tau > 0 for tau, _ in states[0]["stats.staleness"])


def _pulls_ahead_of_own_push(order):
    """How many pulls in ``order`` a shard served before the puller's last push."""
    pulls, pushed, ahead = [0, 0], [0, 0], 0
    for event in order:
        w = event[1]
        if event[0] == "pull":
            ahead += pulls[w] > pushed[w]
            pulls[w] += 1
        else:
            pushed[w] += 1
    return ahead


@pytest.mark.parametrize(
    "case, pipelined",
    [("asp-constant", True), ("ssp1-polynomial", True), ("asp-inverse-max1-dc", False),
     ("bsp", False)],
)  # fmt: skip
def test_the_trace_has_pulls_overtaking_their_own_push_where_the_rule_allows(case, pipelined):
    """stalewise.protocol.pipeline: an ASP/SSP pull reads the snapshots while its push is in
    flight; a DC-ASGD pull (the shard keeps what was pulled) and a pull the BSP gate holds
    are requests behind the push, so the replay above covers both kinds."""
    _, order = run_sim(make_job(case), 9)
    assert (_pulls_ahead_of_own_push(order) > 0) == pipelined


# -- three runtimes, through Job.train -----------------------------------------------------

SIZE = 1200  # elements of leaf "w": large enough for topk(0.01) to drop most of each update


def three_way_grads(params, batch):
    """A deterministic update of the pulled params and the batch number."""
    k = np.float32(batch)
    gw = (params["w"] - np.sin(np.arange(SIZE, dtype=np.float32) + k)).astype(np.float32)
    gb = (params["b"] * np.float32(0.5) - k / np.float32(10)).astype(np.float32)
    return float(np.abs(gw).sum()), {"w": gw, "b": gb}


def three_way_data(worker, workers):
    return itertools.count()


@pytest.fixture
def ray_instance(ray_cluster):
    """The cluster the Ray test files share (conftest.py), this process a driver of it; this
    module's functions travel to its workers by value (they cannot import the tests)."""
    import ray

    module = sys.modules[__name__]
    ray.cloudpickle.register_pickle_by_value(module)
    try:
        yield ray
    finally:
        ray.cloudpickle.unregister_pickle_by_value(module)


def train_three_ways(job_kw, **train_kw):
    """The same BSP job of :func:`three_way_grads` trained by the simulator, local
    processes and Ray (``job_kw``: more ``sw.Job`` keywords); the results by runtime."""
    results = {}
    for runtime in ("sim", "local", "ray"):
        job = sw.Job(
            {"w": np.zeros(SIZE, np.float32), "b": np.ones(4, np.float32)},
            optimizer=sw.optim.adam(0.05),
            consistency=sw.BSP(),
            **job_kw,
        )
        results[runtime] = job.train(
            three_way_grads, runtime=runtime, timeouts=sw.Timeouts(total=120), **train_kw
        )
    return results


@pytest.mark.parametrize("codec", [None, "topk"])
def test_simulator_local_and_ray_train_to_the_same_parameters(codec, ray_instance):
    steps = 12
    codec = sw.codecs.topk(0.01) if codec else sw.codecs.none()
    results = train_three_ways(
        dict(shards=2, codec=codec), data=three_way_data, workers=1, steps=steps
    )
    sim = results["sim"]
    moved = np.abs(sim.params["w"]).sum()
    assert moved > 0.1  # the updates did move the parameters
    for runtime, result in results.items():
        assert result.pushes == steps, f"{runtime}: {result.pushes} pushes, budget {steps}"
        for leaf in ("w", "b"):
            np.testing.assert_allclose(
                result.params[leaf], sim.params[leaf], rtol=0, atol=1e-6, err_msg=runtime
            )


def each_worker_data(worker, workers):
    """Batches that differ by worker, so that a round's mean depends on who pushed."""
    return (10 * k + worker for k in itertools.count())


def test_a_bsp_budget_ends_at_a_round_end_in_every_runtime(ray_instance):
    """Under BSP a budget of 4 pushes for 3 workers is 2 whole rounds (6 pushes): a
    partial last round would apply one worker's push as the whole round's mean. Before
    the rule counted rounds, the simulator stopped at 4 pushes, and the local runtime
    could begin a round only some of its workers went on with."""
    results = train_three_ways({}, data=each_worker_data, workers=3, steps=4)
    for runtime, result in results.items():
        assert result.pushes == 6, f"{runtime}: {result.pushes} pushes, budget 4 for 3 workers"
        for leaf in ("w", "b"):  # two rounds of three: the same mean, whatever the order
            np.testing.assert_allclose(
                result.params[leaf],
                results["sim"].params[leaf],
                rtol=0,
                atol=1e-5,
                err_msg=runtime,
            )
