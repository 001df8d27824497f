"""replicas=2 in the simulator, proved by its fault injector (issue 45's first bar).

A small job (2 workers, 2 shards, 20 pushes; worker 1 3x slower) runs once clean, then
once per process (each worker, each shard's primary and backup) and per message that
process receives, killed just before it, and per message it sends, killed just after
it. A check: every worker's acknowledged push is applied exactly once in every live
copy, each copy's state equals a replay of its log (``pushlog.replay``) from the
initial state bit for bit, and the copies' logs are equal."""

import math
import time
from collections import Counter

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise.protocol import pushlog
from stalewise.runtime.errors import Failures
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.engine import Simulation
from stalewise.runtime.sim.models import Fixed, Network, Service, WorkerTiming

N, STEPS, WORKERS = 6, 20, 2
TARGETS = np.random.default_rng(1).standard_normal((WORKERS, N)).astype(np.float32)
SIM = SimConfig(
    compute=Fixed(1.0),
    network=Network(latency=0.01, bandwidth=1e4),  # a forward (a payload) outlasts an ack
    service=Service(0.001, math.inf),
)


def loss_and_grad(params, batch):
    diff = params["w"] - TARGETS[batch[0]] + np.float32(0.1) * np.sin(np.arange(N) + batch[1])
    return float(diff @ diff), {"w": diff.astype(np.float32)}


def data(worker, workers):
    return ((worker, i) for i in range(10**6))


def make_job(consistency, kind):
    if kind == "grad":
        strategy, optimizer = sw.strategies.gradients(), sw.optim.adam(0.05)
    else:
        strategy = sw.strategies.diloco(local_steps=3, inner=sw.optim.sgd(0.2))
        optimizer = sw.optim.sgd(0.7, momentum=0.9, nesterov=True)
    params = {"w": np.linspace(-1, 1, N, dtype=np.float32)}
    consistency = {"asp": sw.ASP(), "bsp": sw.BSP(), "ssp": sw.SSP(1)}[consistency]
    return sw.Job(params, optimizer=optimizer, consistency=consistency, strategy=strategy,
                  shards=2, replicas=2)  # fmt: skip


def run(job, kill):
    timing = WorkerTiming(SIM, WORKERS, factors=[1.0, 3.0], delays=[0.0, 0.0], seed=0)
    fns = (loss_and_grad, data, job.strategy)
    sim = Simulation(job.config, fns, WORKERS, STEPS, SIM, timing,
                     failures=Failures("restart", None), kill=kill)  # fmt: skip
    sim.run(lambda: False, 1e9, time.perf_counter() + 60)
    assert not sim.heap, "the run stopped with messages in flight"
    return sim


def check(job, sim, case):
    """Every acknowledged push applied once in each copy; each copy equals its log's replay."""
    assert sim.told, case
    for k in range(2):
        assert sim.logs["p", k] == sim.logs["b", k], f"{case}: shard {k}'s copies' logs differ"
        lo, hi = job.config.ranges[k]  # one log: one replay for both copies
        fresh = job.config.build_shard(k, job.config.init[lo:hi].copy(), WORKERS)
        entries = pushlog.decode(b"".join(sim.logs["p", k]))
        applied = Counter(
            (k, h[0], h[3], ack.seq)
            for entry, ack in zip(entries, pushlog.replay(fresh, entries), strict=True)
            if (h := entry.fields.get("header")) and ack and ack.ok and not ack.duplicate
        )
        assert max(applied.values()) == 1, f"{case}: shard {k}'s log applies a push twice"
        lost = {a for a in sim.told if a[0] == k} - set(applied)
        assert not lost, f"{case}: shard {k}'s log lacks acknowledged {sorted(lost)[:3]}"
        replayed = fresh.state_dict()
        for role, shard in {"primary": sim.shards[k], "backup": sim.backups[k].shard}.items():
            state = shard.state_dict()
            for key, x in replayed.items():
                y = state[key]
                same = x.tobytes() == y.tobytes() if isinstance(x, np.ndarray) else x == y
                assert same, f"{case}: shard {k}'s {role} differs from its log's replay in {key}"


def sweep(consistency, kind, every=1):
    """Kills each process at each ``every``-th of its message boundaries (all of them: half
    in a second process); returns the runs and those where a resent push was answered as a
    duplicate (held by the backup)."""
    if every > 1:
        return kill_runs(consistency, kind, every, 0)
    halves = mp_helpers.in_two(kill_runs, consistency, kind, 2)
    return tuple(map(sum, zip(*halves, strict=True)))


def kill_runs(consistency, kind, every, part):
    """The clean run, checked, and a run per ``every``-th kill point from the ``part``-th."""
    job = make_job(consistency, kind)
    clean = run(job, ("none", 0, "in", 0))
    check(job, clean, (consistency, kind, "no kill"))
    assert clean.pushes == STEPS
    kills = [(*name, m) for name, n in sorted(clean.received.items()) for m in range(n)]
    assert {k[0] for k in kills} == {"worker", "primary", "backup"}
    retried = 0
    for kill in kills[part::every]:
        sim = run(job, kill)
        check(job, sim, (consistency, kind, *kill))
        retried += any(s.stats.duplicates for s in sim.shards)
    print(f"{consistency} {kind}: {len(kills[part::every])} runs, {retried} with a duplicate")
    return len(kills[part::every]), retried


CASES = [(c, k) for c in ("asp", "bsp", "ssp") for k in ("grad", "diloco")]


@pytest.mark.slow
@pytest.mark.parametrize("consistency, kind", CASES)
def test_kill_each_process_before_each_message(consistency, kind):
    runs, retried = sweep(consistency, kind)
    assert runs > 600 and retried > 50


@pytest.mark.parametrize("consistency, kind", CASES)
def test_kill_each_process_sampled(consistency, kind):
    runs, retried = sweep(consistency, kind, every=29)
    assert runs > 10 and retried > 0


@pytest.fixture
def plain(monkeypatch):
    """A runtime registered without replicated shards (every built-in one hosts them)."""
    from stalewise import runtime

    monkeypatch.setattr(runtime, "_RUNTIMES", dict(runtime._RUNTIMES))
    runtime.register("plain", "stalewise.runtime.sim:run")
    return "plain"


def test_replicas_option(plain):
    """One check for the value; runtimes that do not host it refuse it in one line."""
    with pytest.raises(ValueError, match="replicas must be 1 or 2, got 3"):
        make_job("asp", "grad").__class__({"w": np.zeros(2, np.float32)}, replicas=3,
                                          optimizer=sw.optim.sgd(0.1))  # fmt: skip
    job = make_job("asp", "grad")
    with pytest.raises(ValueError, match="replicas=2: runtime 'plain' does not host replicated"):
        job.train(loss_and_grad, data=data, workers=2, steps=2, runtime="plain")
    result = job.train(loss_and_grad, data=data, workers=2, steps=8, runtime="sim")
    assert result.pushes == 8 and result.stats["applied"] == 8


def test_replicas_in_a_config(plain):
    """``[server] replicas``: checked by Job, refused by a runtime without replicas."""
    import tomllib

    import stalewise.config as config

    head = '[task]\nname = "least-squares"\n[optimizer]\nname = "sgd"\nlr = 0.1\n'
    raw = tomllib.loads(head + "[server]\nshards = 2\nreplicas = 2\n")
    assert config.parse(raw, runtime="sim").job.config.replicas == 2
    with pytest.raises(config.ConfigError, match=r"server\.replicas.*runtime 'plain' does not"):
        config.parse(raw, runtime="plain")
    raw["server"]["replicas"] = 3
    with pytest.raises(config.ConfigError, match=r"server\.replicas.*must be 1 or 2, got 3"):
        config.parse(raw, runtime="sim")
