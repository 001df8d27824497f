"""Shard.state_dict / load_state_dict: an exact round trip, copies, and checked loads."""

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from stalewise import optim
from stalewise import staleness as st
from stalewise.consistency import ASP, BSP, SSP
from stalewise.protocol import PushHeader, Shard
from stalewise.segments import Segments

N = 5
SEGMENTS = Segments.from_sizes(["layer.w", "layer.b"], [3, 2])
OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "adam": lambda: optim.adam(0.05),
    "lamb": lambda: optim.lamb(0.05, weight_decay=0.01, exclude_from_weight_decay=["b$"]),
    "lars": lambda: optim.lars(0.1, trust_coefficient=0.01),
    "clip_adam": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.05)),
}
CONSISTENCY = {"asp": ASP, "ssp2": lambda: SSP(2), "bsp": BSP}
STALENESS = {
    "constant": st.constant,
    "inverse": lambda: st.inverse(max_staleness=3),
    "dc": lambda: st.constant(dc_lambda=0.5),
    "inverse_dc": lambda: st.inverse(max_staleness=4, dc_lambda=0.25),
}


def make(opt="adam", consistency="asp", staleness="constant", workers=3, dtype=np.float32, seed=0):
    params = np.random.default_rng(seed).standard_normal(N).astype(dtype)
    return Shard(
        params,
        SEGMENTS,
        OPTIMIZERS[opt](),
        workers=workers,
        consistency=CONSISTENCY[consistency](),
        staleness=STALENESS[staleness](),
    )


def assert_same(a, b):
    """Two values of a state dict are equal, arrays bit for bit (dtype and shape included)."""
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and (a.dtype, a.shape) == (b.dtype, b.shape)
        np.testing.assert_array_equal(a, b)
        assert a.tobytes() == b.tobytes()  # also tells -0.0 from 0.0 and NaN payloads apart
    else:
        assert type(a) is type(b) and a == b


def assert_same_state(a, b):
    assert list(a) == list(b)
    for key in a:
        assert_same(a[key], b[key])


# One step of a scenario: (kind, worker, variant, base_back, payload seed). The
# message it makes is worked out from the state of the first shard, then sent
# to both, so both see the same bytes.
OPS = hs.tuples(
    hs.sampled_from(
        ["push"] * 8 + ["replay", "gap", "nan", "leave", "join", "expire", "pull", "pull"]
    ),
    hs.integers(0, 3),
    hs.integers(0, 2),
    hs.integers(0, 6),
    hs.integers(0, 2**16),
)


def payload(seed, dtype, nan=False):
    g = np.random.default_rng(seed).standard_normal(N).astype(dtype)
    if nan:
        g[seed % N] = np.nan
    return g


def run(op, shards):
    """Applies one scenario step to every shard; returns what each answered."""
    kind, w, variant, back, seed = op
    ref = shards[0]
    joined = [v for v in range(ref.workers) if ref.live[v] and ref.incarnation[v]]
    # a plain push comes from a joined live worker when there is one, the rest from anyone
    w = joined[w % len(joined)] if kind == "push" and joined else w % ref.workers
    dtype = ref.params.dtype
    if kind in ("push", "replay", "gap", "nan"):
        seq = int(ref.next_seq[w])
        if kind == "replay":
            seq = max(0, seq - 1 - variant)
        elif kind == "gap":
            seq += 1 + variant
        header = PushHeader(w, seq, max(0, ref.version - back), int(ref.incarnation[w]))
        return [s.push(header, payload(seed, dtype, nan=kind == "nan")) for s in shards]
    if kind == "leave":
        return [s.leave(w) for s in shards]
    if kind == "join":
        return [s.join(w, int(s.incarnation[w]) + 1) for s in shards]
    if kind == "expire":
        return [s.expire_unstarted() for s in shards]
    outs = [np.empty_like(s.params) for s in shards]
    versions = [s.pull(w, out=o) for s, o in zip(shards, outs, strict=True)]
    return [(v, o.tobytes()) for v, o in zip(versions, outs, strict=True)]


def gates(shard):
    return shard.min_clock(), [shard.may_start(w) for w in range(shard.workers)]


@settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    opt=hs.sampled_from(sorted(OPTIMIZERS)),
    consistency=hs.sampled_from(sorted(CONSISTENCY)),
    staleness=hs.sampled_from(sorted(STALENESS)),
    workers=hs.integers(1, 4),
    dtype=hs.sampled_from([np.float32, np.float64]),
    joined=hs.lists(hs.sampled_from([True, True, True, False]), min_size=4, max_size=4),
    ops=hs.lists(OPS, max_size=80),
    split=hs.floats(0, 1),
)
def test_a_loaded_shard_continues_bit_for_bit(
    opt, consistency, staleness, workers, dtype, joined, ops, split
):
    config = dict(opt=opt, consistency=consistency, staleness=staleness, workers=workers)
    a = make(**config, dtype=dtype, seed=1)
    for w in range(workers):
        if joined[w]:
            a.join(w, 1)
    cut = int(split * len(ops))
    for op in ops[:cut]:
        run(op, [a])

    state = a.state_dict()
    b = make(**config, dtype=dtype, seed=2)  # other initial params
    b_params = b.params
    b.load_state_dict(state)
    assert b.params is b_params  # restored into the array the shard was built on
    assert_same_state(b.state_dict(), state)
    assert gates(b) == gates(a)
    assert (b._clocks.live, b._clocks._count) == (a._clocks.live, a._clocks._count)  # rebuilt

    for op in ops[cut:]:
        ack_a, ack_b = run(op, [a, b])
        assert ack_a == ack_b, op
        assert gates(a) == gates(b), op
    assert_same_state(a.state_dict(), b.state_dict())
    assert a.stats == b.stats and a.version == b.version


def busy_shard(opt="adam", consistency="bsp", staleness="dc"):
    """A shard with something in every part of its state: moments, a half round, DC copies."""
    shard = make(opt, consistency, staleness, workers=3)
    for w in range(3):
        shard.join(w, 1)
    for seq in range(2):
        for w in range(3):
            shard.pull(w)
            shard.push(PushHeader(w, seq, shard.version, 1), payload(seq * 3 + w, np.float32))
    shard.push(PushHeader(1, 2, shard.version, 1), payload(7, np.float32))  # half a round
    shard.push(PushHeader(1, 2, shard.version, 1), payload(7, np.float32))  # a duplicate
    shard.push(PushHeader(2, 9, shard.version, 1), payload(8, np.float32))  # a gap
    shard.leave(0)
    return shard


def test_the_state_dict_has_the_documented_keys_and_plain_values():
    state = busy_shard(opt="clip_adam").state_dict()
    assert list(state) == [
        "format",
        "workers",
        "params",
        "version",
        "clocks",
        "next_seq",
        "incarnation",
        "live",
        "round.sum",
        "round.done",
        "round.count",
        "round.waiting",
        "synchronous",
        "pace",
        "pulled.workers",
        "pulled.params",
        "opt_structure",
        "opt.1.count",
        "opt.1.mu",
        "opt.1.nu",
        "stats.applied",
        "stats.rounds",
        "stats.rejected",
        "stats.duplicates",
        "stats.staleness",
        "stats.bytes_in",
        "stats.bytes_out",
        "stats.mode_switches",
    ]
    assert state["opt_structure"] == "(EmptyState(), AdamState(count, mu, nu))"
    arrays = {k: v for k, v in state.items() if isinstance(v, np.ndarray)}
    rest = {k: v for k, v in state.items() if k not in arrays}
    assert json.loads(json.dumps(rest)) == rest  # the counters survive JSON as they are
    assert all(v.flags.c_contiguous and v.flags.owndata for v in arrays.values())
    assert state["round.count"] == 1 and state["stats.duplicates"] == 1
    assert state["stats.rejected"] == {"seq_gap": 1}
    assert state["pulled.workers"].tolist() == [1, 2]  # worker 0 left: its copy went with it


def test_the_state_dict_is_a_copy():
    shard = busy_shard()
    state = shard.state_dict()
    kept = {k: (v.copy() if isinstance(v, np.ndarray) else json.dumps(v)) for k, v in state.items()}
    shard.join(0, 2)
    shard.pull(0)
    for seq in range(3):
        for w in range(3):
            shard.pull(w)
            header = PushHeader(w, int(shard.next_seq[w]), shard.version, int(shard.incarnation[w]))
            shard.push(header, payload(100 + seq, np.float32))
    shard.params[:] = 42.0
    shard.opt_state.mu[:] = 42.0
    shard.stats.rejected["x"] += 1
    shard.stats.staleness[99] += 1
    assert shard.version > state["version"]
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            assert_same(value, kept[key])
        else:
            assert json.dumps(value) == kept[key], key


def test_a_loaded_shard_shares_no_memory_with_the_state_dict():
    state = busy_shard().state_dict()
    shard = make("adam", "bsp", "dc")
    shard.load_state_dict(state)
    before = {k: v.copy() for k, v in state.items() if isinstance(v, np.ndarray)}
    shard.push(PushHeader(2, 2, shard.version, 1), payload(5, np.float32))  # closes the round
    assert shard.version == state["version"] + 1
    for key, value in before.items():
        assert_same(state[key], value)


def test_loading_into_a_shared_params_view_writes_through():
    backing = np.zeros(N + 2, np.float32)
    state = busy_shard().state_dict()
    shard = Shard(
        backing[1:-1],
        SEGMENTS,
        OPTIMIZERS["adam"](),
        workers=3,
        consistency=BSP(),
        staleness=STALENESS["dc"](),
    )
    shard.load_state_dict(state)
    np.testing.assert_array_equal(backing[1:-1], state["params"])
    assert backing[0] == backing[-1] == 0


def test_gates_and_rounds_agree_after_load():
    a = busy_shard(consistency="ssp2", staleness="constant")
    a.push(PushHeader(1, 3, a.version, 1), payload(1, np.float32))
    a.push(PushHeader(1, 4, a.version, 1), payload(2, np.float32))
    b = make("adam", "ssp2", "constant")
    b.load_state_dict(a.state_dict())
    assert gates(b) == gates(a) == (2, [True, False, True])
    c = busy_shard()  # BSP, worker 1 already pushed in this round, worker 0 gone
    d = make("adam", "bsp", "dc")
    d.load_state_dict(c.state_dict())
    ack = d.push(PushHeader(2, 2, d.version, 1), payload(3, np.float32))
    assert ack.ok and d.version == c.version + 1  # worker 2's push closed the round
    assert d.state_dict()["round.count"] == 0


def broken(state, key, value):
    state = dict(state)
    if value is KeyError:
        del state[key]
    else:
        state[key] = value
    return state


BAD = {
    "params-length": ("params", lambda s: np.zeros(N + 1, np.float32)),
    "params-dtype": ("params", lambda s: s["params"].astype(np.float64)),
    "params-list": ("params", lambda s: s["params"].tolist()),
    "workers": ("workers", lambda s: 4),
    "clocks-workers": ("clocks", lambda s: np.zeros(4, np.int64)),
    "clocks-dtype": ("clocks", lambda s: s["clocks"].astype(np.int32)),
    "clocks-negative": ("clocks", lambda s: s["clocks"] - 10),
    "live-dtype": ("live", lambda s: s["live"].astype(np.int64)),
    "missing-version": ("version", lambda s: KeyError),
    "missing-stats": ("stats.staleness", lambda s: KeyError),
    "missing-opt-array": ("opt.nu", lambda s: KeyError),
    "missing-format": ("format", lambda s: KeyError),
    "format": ("format", lambda s: 1),
    "synchronous-type": ("synchronous", lambda s: 1),
    "synchronous-asp": ("synchronous", lambda s: False),
    "pace-length": ("pace", lambda s: np.zeros(2)),
    "version-negative": ("version", lambda s: -1),
    "version-float": ("version", lambda s: 3.0),
    "round-waiting": ("round.waiting", lambda s: s["round.waiting"] + 1),
    "round-sum-length": ("round.sum", lambda s: np.zeros(N - 1, np.float32)),
    "round-sum-empty": ("round.sum", lambda s: np.zeros(0, np.float32)),
    "pulled-ids": ("pulled.workers", lambda s: np.array([1, 1], np.int64)),
    "pulled-range": ("pulled.workers", lambda s: np.array([1, 3], np.int64)),
    "pulled-rows": ("pulled.params", lambda s: s["pulled.params"][:1]),
    "opt-count-dtype": ("opt.count", lambda s: np.zeros((), np.int32)),
    "opt-mu-length": ("opt.mu", lambda s: np.zeros(N + 1, np.float32)),
    "rejected": ("stats.rejected", lambda s: {"seq_gap": -1}),
    "staleness": ("stats.staleness", lambda s: [[0, 1], [0, 2]]),
    "staleness-shape": ("stats.staleness", lambda s: {0: 1}),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_state_is_refused_by_key_and_changes_nothing(case):
    key, make_value = BAD[case]
    good = busy_shard().state_dict()
    bad = broken(good, key, make_value(good))
    shard = busy_shard()
    shard.push(PushHeader(2, 2, shard.version, 1), payload(11, np.float32))  # unlike `good`
    before = shard.state_dict()
    params = shard.params
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")) as info:
        shard.load_state_dict(bad)
    assert "\n" not in str(info.value)
    assert shard.params is params
    assert_same_state(shard.state_dict(), before)


def test_an_unknown_key_is_refused():
    state = busy_shard().state_dict() | {"extra": 1}
    with pytest.raises(ValueError, match="'extra': unknown key"):
        make("adam", "bsp", "dc").load_state_dict(state)


@pytest.mark.parametrize(
    ("saved", "loaded"), [("adam", "sgd"), ("sgd", "adam"), ("adam", "clip_adam"), ("lamb", "lars")]
)
def test_the_optimizer_structure_must_match(saved, loaded):
    state = busy_shard(opt=saved).state_dict()
    shard = busy_shard(opt=loaded)
    before = shard.state_dict()
    with pytest.raises(ValueError, match="'opt_structure'"):
        shard.load_state_dict(state)
    assert_same_state(shard.state_dict(), before)


def test_an_open_bsp_round_does_not_load_into_an_asp_shard():
    state = busy_shard().state_dict()
    assert state["round.count"] == 1
    with pytest.raises(ValueError, match=r"'round\.count'.*BSP round"):
        make("adam", "asp", "dc").load_state_dict(state)


def test_a_shard_between_rounds_keeps_no_round_buffer():
    shard = make("sgd", "asp", "constant")
    assert shard.state_dict()["round.sum"].shape == (0,)
    other = make("sgd", "asp", "constant", seed=3)
    other.load_state_dict(shard.state_dict())
    assert other._round_sum is None


def mid_round(consistency="bsp"):
    """Two workers, 3 rounds, then worker 0's push of round 3: worker 1 owes round 3."""
    shard = make("sgd", consistency, "constant", workers=2)
    for w in range(2):
        shard.join(w, 1)
    for seq in range(3):
        for w in range(2):
            shard.push(PushHeader(w, seq, shard.version, 1), payload(seq * 2 + w, np.float32))
    shard.push(PushHeader(0, 3, shard.version, 1), payload(6, np.float32))
    assert shard.clocks.tolist() == [4, 3] and shard.state_dict()["round.count"] == 1
    return shard


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_a_resumed_job_keeps_the_round_its_workers_owe(order):
    """Resumed mid-round, each worker's next incarnation takes its saved seat: worker 1
    still owes round 3, whose waiting push stays; the round closes with both pushes,
    as in the run that was never stopped (a rejoin that departed first closed it with
    worker 0's push alone and moved worker 1 past it)."""
    a = mid_round()
    b = make("sgd", "bsp", "constant", workers=2, seed=5)
    b.load_state_dict(a.state_dict())
    b.resume()
    for w in order:
        b.join(w, 2)
    assert b.clocks.tolist() == [4, 3] and b.version == a.version == 3
    assert gates(b) == gates(a) == (3, [False, True])
    last = payload(7, np.float32)
    assert a.push(PushHeader(1, 3, a.version, 1), last.copy()).ok
    assert b.push(PushHeader(1, 0, b.version, 2), last.copy()).ok
    assert b.version == a.version == 4 and b.clocks.tolist() == [4, 4]
    assert_same(b.params, a.params)
    assert gates(b) == gates(a) == (4, [True, True])


def test_a_resumed_seat_nobody_takes_is_dropped_when_the_lease_ends():
    shard = make("sgd", "bsp", "constant", workers=2)
    shard.load_state_dict(mid_round().state_dict())
    shard.resume()
    shard.join(0, 2)
    assert shard.expire_unstarted() == [1]
    assert shard.version == 4 and not shard.live[1]  # the round closed without worker 1
    assert shard.may_start(0)


def test_load_alone_is_exact_and_a_rejoin_then_departs_the_old_incarnation():
    """Without resume() the loaded shard is the saved one: a join is a restart mid-run."""
    a, b = mid_round(), make("sgd", "bsp", "constant", workers=2)
    b.load_state_dict(a.state_dict())
    for s in (a, b):
        s.join(1, 2)
    assert a.clocks.tolist() == b.clocks.tolist() == [4, 4] and a.version == b.version == 4
    assert b.expire_unstarted() == []
