"""Streaming DiLoCo (stalewise.strategies.streaming) against hand-written references.

One fragment without delay is DiLoCo bit for bit (synchronous and asynchronous,
in the simulator); two fragments push the expected fragment after the expected
inner steps; the delayed merge matches a hand computation; the server's
``lazy_leaves`` steps only the leaves a push touches; bad arguments are refused
in one line naming the argument; and a 2-worker local-runtime run converges.
"""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

import stalewise as sw
from stalewise import tasks
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed
from stalewise.segments import Segments
from stalewise.strategies import config_key, diloco, lazy_leaves, streaming_diloco

TASK = tasks.get("least-squares", n=512, d=16, batch_size=32, noise=0.1)


def init_params() -> dict:
    """The least-squares task's 16 values as two leaves, ``a`` and ``b``, 8 each."""
    x = TASK.init_params()["x"]
    return {"a": x[:8].copy(), "b": x[8:].copy()}


def loss_and_grad(params, batch):  # module level: the local runtime's workers import it
    loss, g = TASK.loss_and_grad({"x": np.concatenate([params["a"], params["b"]])}, batch)
    return loss, {"a": g["x"][:8], "b": g["x"][8:]}


def evaluate(params) -> float:
    return TASK.evaluate({"x": np.concatenate([params["a"], params["b"]])})["loss"]


def _sim(strategy, consistency, workers, steps, **kw):
    job = sw.Job(init_params(), strategy=strategy, consistency=consistency, **kw)
    return job.train(
        loss_and_grad,
        data=TASK.batches,
        workers=workers,
        steps=steps,
        runtime=sw.Simulation(SimConfig(compute=Fixed(0.01))),
    )


# -- one fragment, no delay: DiLoCo ------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["bsp", "asp"])
def test_one_fragment_without_delay_is_diloco_bit_for_bit(asynchronous):
    workers, h, rounds = 2, 5, 6
    inner = sw.optim.adamw(0.02)
    kw = {"asynchronous": True, "every": workers} if asynchronous else {}
    consistency = sw.ASP() if asynchronous else sw.BSP()
    ref = _sim(diloco(local_steps=h, inner=inner, **kw), consistency, workers, workers * rounds)
    s = streaming_diloco(local_steps=h, inner=inner, fragments=1, delay=0, alpha=0.0, **kw)
    same = diloco(local_steps=h, inner=inner, **kw).server_optimizer(workers)
    assert config_key(s.server_optimizer(workers)) == config_key(same)
    got = _sim(s, consistency, workers, workers * rounds)
    assert got.pushes == ref.pushes == workers * rounds
    assert_array_equal(got.flat, ref.flat)
    assert not np.array_equal(got.flat, np.concatenate(list(init_params().values())))


# -- the schedule ----------------------------------------------------------------------------


def _fake_rounds(s, rounds, pulls=None):
    """Drives ``s.step`` by hand; each pull returns ``pulls[r]`` (default: the initial
    params); returns the steps and the worker state."""
    params = init_params()
    state = s.init(params)
    batches = TASK.batches(0, 1)
    steps = []
    for r in range(rounds):
        pulled = params if pulls is None else pulls[r]
        steps.append(s.step(state, pulled, loss_and_grad, batches))
    return steps, state


@pytest.mark.parametrize(
    "offsets, expected",
    [
        (None, [(5, 1), (10, 0), (15, 1), (20, 0)]),  # staggered: offsets 0 and 5
        ([3, 7], [(3, 0), (7, 1), (13, 0), (17, 1)]),
    ],
)
def test_two_fragments_push_their_fragment_at_their_offsets(offsets, expected):
    s = streaming_diloco(
        local_steps=10, inner=sw.optim.sgd(0.05), fragments=["^a$", "^b$"], offsets=offsets
    )
    steps, state = _fake_rounds(s, 4)
    assert state.pushed == expected
    at = [0] + [t for t, _ in expected]
    assert [st.local_steps for st in steps] == [b - a for a, b in itertools.pairwise(at)]
    for st, (_, frag) in zip(steps, expected, strict=True):
        pushed, other = ("a", "b") if frag == 0 else ("b", "a")
        assert (st.update[other] == 0).all()  # zero outside the fragment
        assert (st.update[pushed] != 0).all()


def test_equal_slices_cut_at_leaf_boundaries():
    from stalewise.strategies.streaming import fragment_runs

    seg = Segments.from_sizes(["e", "l0", "l1", "l2", "head"], [40, 20, 20, 20, 4])
    assert fragment_runs(seg, 2) == [[(0, 60)], [(60, 104)]]
    assert fragment_runs(seg, 3) == [[(0, 40)], [(40, 60)], [(60, 104)]]
    patterns = (("^l[02]$",), ("^e$", "head"), ("^l1$",))
    assert fragment_runs(seg, patterns) == [
        [(40, 60), (80, 100)],
        [(0, 40), (100, 104)],
        [(60, 80)],
    ]
    with pytest.raises(ValueError, match="leaf 'head' matches no fragment"):
        fragment_runs(seg, (("^e$",), ("^l",)))
    with pytest.raises(ValueError, match=r"fragment 1 \(\('zzz',\)\) matches no leaf"):
        fragment_runs(seg, ((".",), ("zzz",)))
    with pytest.raises(ValueError, match="fragments=6 cuts the model at leaf boundaries"):
        fragment_runs(seg, 6)


# -- the delayed merge, by hand ----------------------------------------------------------------


def test_delayed_merge_matches_a_hand_computation():
    """H = 4, fragments a (offset 0) and b (offset 2), delay 1, alpha 0.5, inner SGD
    with lr 0.5 on ``0.5 |p - 1|^2`` (each step: ``p <- 0.5 p + 0.5``). The pulls
    return arbitrary globals, so each merge's source is visible."""

    def lg(p, _):
        return 0.0, {"a": p["a"] - 1.0, "b": p["b"] - 1.0}

    def sgd(x, n):
        for _ in range(n):
            x = 0.5 * x + 0.5
        return x

    def g(a, b):
        return {"a": np.full(2, a), "b": np.full(2, b)}

    s = streaming_diloco(
        local_steps=4, inner=sw.optim.sgd(0.5), fragments=["a", "b"], delay=1, alpha=0.5
    )
    assert s.offsets == (0, 2)
    pulls = [g(0.0, 0.0), g(10.0, 20.0), g(-5.0, 7.0), g(3.0, -2.0)]
    state = s.init(pulls[0])
    it = iter([None] * 100)
    ups = [s.step(state, p, lg, it) for p in pulls]
    # step 1: from the pull (0, 0), t 0 -> 2, push b (ref 0)
    a, b = sgd(0.0, 2), sgd(0.0, 2)
    assert_allclose(ups[0].update["b"], 0.0 - b)
    assert_allclose(ups[0].update["a"], 0.0)
    # step 2: pull (10, 20); t 2 -> 3, merge b with 20; t 3 -> 4, push a (ref 0)
    a, b = sgd(a, 1), sgd(b, 1)
    b, ref_b = 0.5 * b + 0.5 * 20.0, 20.0
    a, b = sgd(a, 1), sgd(b, 1)
    assert_allclose(ups[1].update["a"], 0.0 - a)
    assert_allclose(ups[1].update["b"], 0.0)
    # step 3: pull (-5, 7); t 4 -> 5, merge a with -5 (b's 7 is not used); t 5 -> 6, push b
    a, b = sgd(a, 1), sgd(b, 1)
    a, ref_a = 0.5 * a + 0.5 * -5.0, -5.0
    a, b = sgd(a, 1), sgd(b, 1)
    assert_allclose(ups[2].update["b"], ref_b - b)
    # step 4: pull (3, -2); t 6 -> 7, merge b with -2; t 7 -> 8, push a
    a, b = sgd(a, 1), sgd(b, 1)
    b = 0.5 * b + 0.5 * -2.0
    a, b = sgd(a, 1), sgd(b, 1)
    assert_allclose(ups[3].update["a"], ref_a - a)
    assert_allclose(state.local, np.concatenate([np.full(2, a), np.full(2, b)]))
    assert [u.local_steps for u in ups] == [2, 2, 2, 2]


# -- the server: lazy_leaves --------------------------------------------------------------------


def test_lazy_leaves_steps_only_the_leaves_a_push_touches():
    seg = Segments.from_sizes(["a", "b"], [2, 3])
    inner = sw.optim.sgd(0.7, momentum=0.9, nesterov=True)
    opt = lazy_leaves(inner)
    p = np.zeros(5)
    state = opt.init(p, seg)
    ref_a, ref_b = np.zeros(2), np.zeros(3)
    sa, sb = inner.init(ref_a), inner.init(ref_b)
    rng = np.random.default_rng(0)
    for frag in [0, 1, 0, 0, 1]:
        g = np.zeros(5)
        if frag == 0:
            g[:2] = rng.standard_normal(2)
            inner.apply(g[:2].copy(), sa, ref_a)
        else:
            g[2:] = rng.standard_normal(3)
            inner.apply(g[2:].copy(), sb, ref_b)
        opt.apply(g, state, p)
        assert_array_equal(p, np.concatenate([ref_a, ref_b]))
    updates, _ = opt.update(np.ones(5), state, p)
    assert updates.shape == (5,) and (updates != 0).all()
    s = streaming_diloco(local_steps=4, fragments=2, asynchronous=True, every=3)
    expected = lazy_leaves(sw.optim.delayed_nesterov(0.7, 0.9, every=3))
    assert config_key(s.server_optimizer()) == config_key(expected)


def test_two_fragments_train_in_the_simulator_sync_and_async():
    start = evaluate(init_params())
    for consistency, kw in [(sw.BSP(), {}), (sw.ASP(), {"asynchronous": True, "every": 2})]:
        s = streaming_diloco(
            local_steps=8, inner=sw.optim.adamw(0.02), fragments=2, delay=2, alpha=0.5, **kw
        )
        r = _sim(s, consistency, 2, 40)
        assert r.pushes == 40
        assert evaluate(r.params) < 0.1 * start, consistency


# -- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, msg",
    [
        ({"local_steps": 0}, "local_steps must be an integer >= 1"),
        ({"fragments": 0}, "fragments must be an integer >= 1"),
        ({"fragments": "a"}, "fragments must be an integer >= 1 or a non-empty list"),
        ({"fragments": ["a", "("]}, "fragments: bad pattern '\\('"),
        ({"fragments": 20}, "fragments: 20 fragments need local_steps >= 20"),
        ({"fragments": 2, "offsets": [0]}, "offsets must be 2 integers"),
        ({"fragments": 2, "offsets": [0, 0]}, "offsets must be distinct integers in"),
        ({"fragments": 2, "offsets": [0, 10]}, r"offsets must be distinct integers in \[0, "),
        ({"delay": 10}, r"delay must be an integer in \[0, local_steps=10\)"),
        ({"delay": -1}, "delay must be an integer"),
        ({"alpha": 1.5}, r"alpha must be a number in \[0, 1\]"),
        ({"alpha": "x"}, "alpha must be a number"),
        ({"every": 2}, "every= is delayed Nesterov's N; it needs asynchronous=True"),
        ({"outer_lr": 0}, "outer_lr must be"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_naming_them(kw, msg):
    args = {"local_steps": 10, **kw}
    with pytest.raises(ValueError, match=msg) as e:
        streaming_diloco(**args)
    assert "\n" not in str(e.value) and "streaming_diloco" in str(e.value)


def test_the_strategy_pickles_and_compares_by_configuration():
    s = streaming_diloco(local_steps=10, fragments=["^a", "^b"], delay=2, alpha=0.5)
    assert pickle.loads(pickle.dumps(s)) == s
    assert s != streaming_diloco(local_steps=10, fragments=["^a", "^b"], delay=3, alpha=0.5)
    assert "fragments=(('^a',), ('^b',))" in repr(s)


# -- a real run ------------------------------------------------------------------------------------


def test_two_workers_converge_in_the_local_runtime(no_leaks):
    start = evaluate(init_params())
    s = streaming_diloco(
        local_steps=8,
        inner=sw.optim.adamw(0.02),
        fragments=2,
        delay=1,
        alpha=0.5,
        asynchronous=True,
        every=2,
    )
    job = sw.Job(init_params(), strategy=s)
    result = job.train(
        loss_and_grad, data=TASK.batches, workers=2, steps=60, timeouts=sw.Timeouts(total=120)
    )
    assert result.pushes >= 60
    assert evaluate(result.params) < 0.1 * start


# -- the config file ---------------------------------------------------------------------------------


def test_a_config_file_names_streaming_diloco():
    from stalewise.config import ConfigError, strategy_from_table

    table = {
        "name": "streaming_diloco",
        "local_steps": 12,
        "fragments": ["^a", "^b"],
        "delay": 2,
        "alpha": 0.5,
        "inner": {"name": "adamw", "lr": 0.01},
    }
    s = strategy_from_table(table)
    assert s == streaming_diloco(
        local_steps=12, inner=sw.optim.adamw(0.01), fragments=["^a", "^b"], delay=2, alpha=0.5
    )
    with pytest.raises(
        ConfigError, match=r"strategy\.delay: must be an integer in \[0, local_steps=12\), got 12"
    ) as e:
        strategy_from_table({**table, "delay": 12})
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"strategy\.reset_inner: unknown option"):
        strategy_from_table({**table, "reset_inner": True})
