"""Delta pulls (stalewise.protocol.pulls): references kept bit-identical on both sides,
lossless deltas exact, what a lossy codec did not send sent later, exact byte counts,
corrupt payloads refused, the simulator charging the real payloads, and the option's
checks in ``sw.Job``, TOML and the CLI.
"""

from __future__ import annotations

import dataclasses
import doctest
import itertools

import numpy as np
import pytest

import stalewise as sw
from stalewise import codecs, config, tasks
from stalewise.cli import main
from stalewise.codecs import PayloadError
from stalewise.protocol import PushHeader, pulls
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network

LOSSY = [
    codecs.fp16(),
    codecs.bf16(),
    codecs.int8(),
    codecs.topk(0.1),
    codecs.topk(0.01),
    codecs.sign(),
]


class Rig:
    """A 2-shard job (a 8-value leaf and a 3000-value leaf cut by the shard boundary),
    its shards over one flat vector, a pull server beside each and one worker's copy."""

    def __init__(self, pull_codec, dtype=np.float32):
        rng = np.random.default_rng(0)
        params = {"b": np.zeros(8, dtype), "w": rng.standard_normal(3000).astype(dtype)}
        self.cfg = sw.Job(
            params, optimizer=sw.optim.sgd(1.0), shards=2, pull_codec=pull_codec
        ).config
        self.flat = self.cfg.init.copy()
        self.ranges = self.cfg.ranges
        self.shards = [
            self.cfg.build_shard(k, self.flat[lo:hi], 1) for k, (lo, hi) in enumerate(self.ranges)
        ]
        for s in self.shards:
            s.join(0, 1)
        self.servers = [
            pulls.PullServer.for_shard(self.cfg, k, s) for k, s in enumerate(self.shards)
        ]
        self.replica = pulls.Replica.for_job(self.cfg)
        self.seq = 0

    def push(self, update):
        """A real push to every shard (SGD with lr 1: the params move by -update)."""
        for k, (lo, hi) in enumerate(self.ranges):
            header = PushHeader(0, self.seq, self.shards[k].version, 1)
            assert self.shards[k].push(header, update[lo:hi].copy()).ok
        self.seq += 1

    def pull(self):
        """One pull from every shard; returns the Pull objects."""
        out = []
        for k in range(len(self.ranges)):
            p = self.servers[k].pull(0, self.replica.have(k))
            assert self.replica.apply(k, p.payload) == self.shards[k].version
            out.append(p)
        return out

    def same_references(self):
        """The shard's reference and the worker's copy, bit for bit."""
        for k, (lo, hi) in enumerate(self.ranges):
            ref = self.servers[k].reference(0)
            assert ref.tobytes() == self.replica.params[lo:hi].tobytes(), k


# -- the protocol object ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lossless_delta_pulls_are_exact_and_sparse_when_few_values_changed(dtype):
    rig = Rig(codecs.none(), dtype)
    first = rig.pull()
    assert all(p.full for p in first)
    np.testing.assert_array_equal(rig.replica.params, rig.flat)
    item = np.dtype(dtype).itemsize
    rng = np.random.default_rng(1)
    for changed in (5, 3008, 40, 0):  # a few values, all of them, a few, none
        g = np.zeros(rig.flat.size, dtype)
        g[rng.choice(rig.flat.size, changed, replace=False)] = rng.standard_normal(changed)
        if changed:
            rig.push(g)
        got = rig.pull()
        assert not any(p.full for p in got)
        np.testing.assert_array_equal(rig.replica.params, rig.flat)  # exact
        rig.same_references()
        total = sum(len(p.payload) for p in got)
        if changed == 3008:  # every value: the new values, dense (header overheads only)
            assert item * 3008 < total < item * 3008 + 200
        else:  # indices and values of what changed
            assert total <= 2 * 24 + 3 * 20 + changed * (2 + item)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("codec", LOSSY, ids=repr)
def test_lossy_delta_pulls_keep_both_references_identical_and_send_the_rest_later(codec, dtype):
    rig = Rig(codec, dtype)
    rng = np.random.default_rng(2)
    full = sum(len(p.payload) for p in rig.pull())
    for _ in range(15):
        rig.push((rng.standard_normal(rig.flat.size) * 0.01).astype(dtype))
        got = rig.pull()
        rig.same_references()
        assert sum(len(p.payload) for p in got) < full  # a delta is smaller than the slice
    # no new pushes: every pull sends more of what is left, until nothing is
    errors, norms = [], []
    for _ in range(400):
        rig.pull()
        rig.same_references()
        errors.append(float(np.abs(rig.replica.params - rig.flat).max()))
        norms.append(float(np.linalg.norm(rig.replica.params - rig.flat)))
        if errors[-1] == 0.0:
            break
    assert all(b <= a * (1 + 1e-6) for a, b in itertools.pairwise(norms))  # never further
    if isinstance(codec, codecs.Sign):  # a poor pull codec: it converges, slowly
        assert norms[-1] < norms[0] / 10
    elif isinstance(codec, codecs.FP16) and dtype == np.float64:
        assert errors[-1] <= 2**-25  # fp16 cannot carry a delta below its smallest value
    else:
        assert errors[-1] == 0.0, errors[-5:]  # exact at last (the sparse blocks finish it)


def test_byte_counts_equal_the_payloads_and_scale_every_piece():
    for codec in [codecs.none(), *LOSSY]:
        rig = Rig(codec)
        rng = np.random.default_rng(3)
        for changed in (None, 10, 3008):
            if changed is not None:
                g = np.zeros(rig.flat.size, np.float32)
                g[rng.choice(rig.flat.size, changed, replace=False)] = 0.01
                rig.push(g)
            for p in rig.pull():
                assert p.nbytes() == p.nbytes(1.0) == len(p.payload)
                assert p.nbytes(1000.0) > 100 * p.nbytes()  # every piece scaled alike
        assert rig.shards[0].stats.bytes_out + rig.shards[1].stats.bytes_out > 0
    # a full pull of a model scale times larger: its raw values plus the headers
    p = Rig(codecs.int8()).pull()[0]
    n = p.parts[0][1]
    assert p.nbytes(10.0) == 24 + 12 + 4 * 10 * n


def test_a_new_incarnation_and_an_unknown_reference_get_a_full_pull():
    rig = Rig(codecs.int8())
    rig.pull()
    rig.push(np.full(rig.flat.size, 0.01, np.float32))
    assert not rig.pull()[0].full
    server, shard = rig.servers[0], rig.shards[0]
    assert server.pull(0, have=1).full  # the worker names a reference the shard no longer has
    shard.join(0, 2)  # a restarted worker: a new incarnation
    assert server.pull(0, have=2).full
    server.forget(0)
    assert server.reference(0) is None
    assert server.pull(0, have=1).full


def test_a_corrupt_pull_payload_is_refused_and_changes_nothing():
    rig = Rig(codecs.topk(0.1))
    rig.pull()
    rig.push(np.random.default_rng(4).standard_normal(rig.flat.size).astype(np.float32))
    have = rig.replica.have(0)
    good = rig.servers[0].pull(0, have).payload
    assert good[1] != pulls.FULL
    before = rig.replica.params.copy()

    def refused(payload, match, k=0):
        with pytest.raises(PayloadError, match=match):
            rig.replica.apply(k, payload)
        assert rig.replica.params.tobytes() == before.tobytes()
        assert rig.replica.have(0) == have

    refused(good[:-1], "shard 0")  # truncated
    refused(good + b"\0", "too many")  # padded
    refused(good[:10], "truncated")
    refused(b"\x00" + good[1:], "not a pull payload")
    refused(good, "payload is shard 0's", k=1)  # another shard's
    refused("text", "must be bytes")
    bad = bytearray(good)
    bad[pulls.HEADER.size + 1] = 3  # the first piece's codec id: int8, not none()
    refused(bad, "leaf 'b'")
    # a delta to a reference the worker does not hold (applied twice)
    rig.replica.apply(0, good)
    before, have = rig.replica.params.copy(), rig.replica.have(0)
    refused(good, "a delta to reference")
    # NaN in the values
    nan = bytearray(good)
    values = np.frombuffer(nan, np.float32, 4, len(nan) - 16)
    values[:] = np.nan
    refused(_renumber(nan, have + 1), "non-finite")
    # out-of-order sparse indices
    shard = rig.shards[0]
    shard.params[[3, 5]] += 1.0  # a small change: a sparse block
    p = rig.servers[0].pull(0, have)
    assert p.parts[0][0] is None  # the bias leaf travels as a sparse block
    swapped = bytearray(p.payload)
    at = pulls.HEADER.size + pulls.SPARSE.size
    swapped[at], swapped[at + 1] = swapped[at + 1], swapped[at]
    refused(swapped, "out of order")
    # after a refused delta the next request names the old reference: a full pull mends it
    again = rig.servers[0].pull(0, rig.replica.have(0))
    assert again.full
    rig.replica.apply(0, again.payload)
    lo, hi = rig.ranges[0]
    np.testing.assert_array_equal(rig.replica.params[lo:hi], shard.params)


def _renumber(payload: bytearray, number: int) -> bytearray:
    """The payload with its reference number set (so a test reaches the piece checks)."""
    fields = list(pulls.HEADER.unpack_from(payload, 0))
    fields[-1] = number
    pulls.HEADER.pack_into(payload, 0, *fields)
    return payload


def test_docstring_example_runs():
    assert doctest.testmod(pulls, raise_on_error=True).failed == 0


# -- the simulator ----------------------------------------------------------------------------

SIM = SimConfig(compute=Fixed(0.01), network=Network(latency=1e-4, bandwidth=1.25e7))


def _digits(pull_codec, codec=None, steps=600, model_bytes=None, consistency=None):
    task = tasks.get("digits")
    job = sw.Job(
        task.init_params(),
        optimizer=sw.optim.sgd(0.1),
        shards=2,
        codec=codec,
        pull_codec=pull_codec,
        consistency=consistency or sw.ASP(),
    )
    return job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=4,
        steps=steps,
        runtime=sw.Simulation(dataclasses.replace(SIM, model_bytes=model_bytes)),
        evaluate=task.evaluate,
        metrics=sw.Metrics(every=1e9),
    )


def test_delta_pulls_in_the_simulator_learn_and_charge_the_real_payloads():
    full = _digits(None)
    raw = full.stats["sim"]["pull_bytes"]
    assert raw == 4810 * 4  # the whole model, every pull
    for codec, floor in [(codecs.int8(), 3.5), (codecs.topk(0.1), 5.0)]:
        r = _digits(codec)
        s = r.stats["sim"]
        assert r.stats["applied"] == r.pushes == 600
        # the links carried exactly the payloads the shards sent (bytes_out: their lengths,
        # and the evaluations' full reads of the params, one per record)
        sent = s["pull_bytes"] * r.pushes + raw * len(r.records)
        assert r.stats["bytes_out"] == pytest.approx(sent, rel=1e-12)
        assert raw / s["pull_bytes"] >= floor, codec
        assert s["pull_time_mean"] < full.stats["sim"]["pull_time_mean"]
        # learns: within 1.5 accuracy points of full pulls (measured: the same or better)
        assert r.records[-1]["accuracy"] >= full.records[-1]["accuracy"] - 0.015, codec
        assert r.records[-1]["accuracy"] > 0.9
    # with topk pushes few values change between pulls: exact sparse pulls, far smaller
    r = _digits(codecs.none(), codec=codecs.topk(0.01))
    assert raw / r.stats["sim"]["pull_bytes"] >= 5.0
    assert r.records[-1]["accuracy"] > 0.9


def test_model_bytes_scale_the_pull_payloads_and_save_time():
    big = 400_000_000
    # under BSP every pull waits for its round and is on the critical path (under ASP a
    # gradient worker's pull overlaps its push, whose transfer alone then sets the pace)
    full = _digits(None, steps=200, model_bytes=big, consistency=sw.BSP())
    delta = _digits(codecs.int8(), steps=200, model_bytes=big, consistency=sw.BSP())
    assert full.stats["sim"]["pull_bytes"] == pytest.approx(big)
    ratio = full.stats["sim"]["pull_bytes"] / delta.stats["sim"]["pull_bytes"]
    # int8: a byte a value and a scale per 4096; the first pull of each worker is full
    assert 3.5 < ratio < 4.0
    assert delta.time < full.time


def test_a_restarted_worker_gets_a_full_pull_and_goes_on():
    from stalewise.runtime.sim.models import Failure

    task = tasks.get("digits")
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), pull_codec=codecs.int8())
    sim = dataclasses.replace(SIM, failures=(Failure(worker=1, time=0.5),), restart_delay=0.1)
    r = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=3,
        steps=400,
        runtime=sw.Simulation(sim),
        evaluate=task.evaluate,
        metrics=sw.Metrics(every=1e9),
    )
    assert [e["action"] for e in r.failures] == ["restarted"]
    assert r.stats["applied"] == 400 and r.records[-1]["accuracy"] > 0.85


# -- the option ---------------------------------------------------------------------------


def test_job_takes_a_pull_codec_and_the_local_runtime_refuses_it():
    params = {"w": np.zeros(600, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(0.1), pull_codec=codecs.int8())
    assert job.config.pull_codec == codecs.int8()
    assert sw.Job(params, optimizer=sw.optim.sgd(0.1)).config.pull_codec is None
    with pytest.raises(TypeError, match=r"pull_codec must be a Policy \(e.g. sw.codecs.int8"):
        sw.Job(params, optimizer=sw.optim.sgd(0.1), pull_codec="int8")
    fn = lambda p, b: (0.0, p)  # noqa: E731
    with pytest.raises(ValueError, match="pull_codec=int8\\(\\): the local runtime's pulls read"):
        job.train(fn, data=[[None]], workers=1, steps=1, runtime="local")
    with pytest.raises(ValueError, match="shared-memory snapshot"):
        job.serve(workers=1)
    from stalewise.runtime.local import train as local_train

    with pytest.raises(ValueError, match="shared-memory snapshot"):  # the runtime itself
        local_train.run(job.config, job.strategy, None)


def test_config_server_pull_codec_and_the_cli_flag(tmp_path, capsys):
    base = {"task": {"name": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1}}
    sim = {"run": {"runtime": "sim"}}
    cfg = config.parse({**base, "server": {"pull_codec": "int8"}, **sim})
    assert cfg.job.config.pull_codec == codecs.int8()
    assert config.parse({**base, **sim}).job.config.pull_codec is None
    assert (
        config.parse({**base, "server": {"pull_codec": "full"}, **sim}).job.config.pull_codec
        is None
    )
    cfg = config.parse({**base, "server": {"pull_codec": "int8"}, **sim}, pull_codec="topk:0.1")
    assert cfg.job.config.pull_codec == codecs.topk(0.1)
    for server, kw, run, key, msg in [
        ({"pull_codec": "gzip"}, {}, sim, "server.pull_codec", "unknown codec 'gzip'"),
        ({"pull_codec": 8}, {}, sim, "server.pull_codec", "expected a codec name"),
        ({}, {"pull_codec": "topk:2"}, sim, "--pull-codec", "fraction must be a number"),
        ({"pull_codec": "int8"}, {}, {}, "server.pull_codec", "shared-memory snapshot"),
    ]:
        with pytest.raises(config.ConfigError, match=msg) as e:
            config.parse({**base, "server": server, **run}, **kw)
        assert e.value.key == key
    path = tmp_path / "job.toml"
    path.write_text(
        '[task]\nname = "least-squares"\nargs = { n = 64, d = 4 }\n'
        '[optimizer]\nname = "sgd"\nlr = 0.05\n[run]\nworkers = 2\nsteps = 40\nruntime = "sim"\n'
    )
    assert main(["train", str(path), "--pull-codec", "bogus", "-q"]) == 2
    assert "--pull-codec: unknown codec 'bogus'" in capsys.readouterr().err
    assert main(["train", str(path), "--pull-codec", "int8", "--runtime", "local", "-q"]) == 2
    assert "--pull-codec: pull_codec=int8(): the local runtime" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(["train", str(path), "--pull-codec", "int8", "--out", str(out), "-q"]) == 0
    assert (out / "metrics.jsonl").exists()
