"""Codecs (stalewise.codecs) and compressed pushes (stalewise.protocol.compress).

Round trips within each codec's stated bound, exact byte counts, refusals of
corrupt payloads, error feedback, sharded payloads, and codecs in the simulator.
"""

from __future__ import annotations

import dataclasses
import doctest
import math
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import stalewise as sw
from stalewise import codecs, config, tasks
from stalewise.cli import main
from stalewise.codecs import PayloadError
from stalewise.protocol import PushHeader, Verdict, compress
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network
from stalewise.segments import Segments

ALL = [
    codecs.none(),
    codecs.fp16(),
    codecs.bf16(),
    codecs.int8(),
    codecs.int8(block=64),
    codecs.int4(),
    codecs.int4(block=64),
    codecs.topk(0.01),
    codecs.topk(0.3),
    codecs.sign(),
]
LOSSY = [c for c in ALL if not c.lossless]


def vec(n, seed=0, scale=1.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * scale).astype(dtype)


def within_bound(codec, x, d):
    """Asserts the bound each codec's docstring states, for finite float32 ``x``."""
    x64, d64 = x.astype(np.float64), d.astype(np.float64)
    err = np.abs(d64 - x64)
    if isinstance(codec, codecs.NoCodec):
        np.testing.assert_array_equal(d, x)
    elif isinstance(codec, codecs.FP16):
        clamped = np.clip(x64, -65504, 65504)
        assert (np.abs(d64 - clamped) <= np.maximum(2**-11 * np.abs(clamped), 2**-25)).all()
    elif isinstance(codec, codecs.BF16):
        assert (err <= np.maximum(2**-8 * np.abs(x64), 2**-134)).all()
    elif isinstance(codec, codecs.Int8):
        b = codec.block
        for lo in range(0, x.size, b):
            top = np.abs(x64[lo : lo + b]).max()
            subnormal_scale = 2**-143 if top < 2**-119 else 0.0  # see Int8's docstring
            assert (err[lo : lo + b] <= top / 254 * (1 + 1e-4) + subnormal_scale).all()
    elif isinstance(codec, codecs.Int4):
        b = codec.block
        for lo in range(0, x.size, b):
            top = np.abs(x64[lo : lo + b]).max()
            subnormal_scale = 2**-146 if top < 2**-119 else 0.0  # see Int4's docstring
            assert (err[lo : lo + b] <= top / 14 * (1 + 1e-4) + subnormal_scale).all()
    elif isinstance(codec, codecs.TopK):
        kept = d != 0
        assert ((d == x) | ~kept).all()  # kept values exact, the others zero
        assert kept.sum() <= codec.k(x.size)
        if kept.any() and (~kept).any():
            assert np.abs(x[kept]).min() >= np.abs(x[~kept]).max()
    elif isinstance(codec, codecs.Sign):
        if x.size:
            assert (np.signbit(d) == np.signbit(x)).all()
            assert math.isclose(np.abs(d64).sum(), np.abs(x64).sum(), rel_tol=1e-5, abs_tol=1e-30)
    else:
        raise AssertionError(codec)


# -- round trips and byte counts --------------------------------------------------------


@pytest.mark.parametrize("codec", ALL, ids=repr)
@pytest.mark.parametrize("n", [0, 1, 7, 255, 256, 257, 4097, 70_001, 300_000])
def test_round_trip_within_bound_and_exact_byte_count(codec, n):
    x = vec(n, seed=n)
    payload = codec.encode(x)
    assert len(payload) == codec.nbytes(n)
    d = codec.decode(payload)
    assert d.dtype == np.float32 and d.shape == (n,)
    within_bound(codec, x, d)


@given(
    x=hnp.arrays(
        np.float32,
        st.integers(0, 2000),
        elements=st.floats(-1e6, 1e6, width=32, allow_subnormal=True),
    ),
    which=st.sampled_from(ALL),
)
@example(x=np.array([2.98e-43], np.float32), which=codecs.int8())  # a subnormal int8 scale
@example(x=np.array([2.98e-43, -1e-45, 7e-44], np.float32), which=codecs.int4())  # int4's
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_round_trip_property(x, which):
    payload = which.encode(x)
    assert len(payload) == which.nbytes(x.size)
    within_bound(which, x, which.decode(payload))


def test_lossless_codecs_are_exact_and_keep_float64():
    x = vec(1000, dtype=np.float64) * 1e-300
    c = codecs.none()
    assert len(c.encode(x)) == c.nbytes(1000, np.float64) == 12 + 8000
    np.testing.assert_array_equal(c.decode(c.encode(x)), x)
    # float16 and bfloat16 values survive their codec exactly
    h = vec(1000).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(codecs.fp16().decode(codecs.fp16().encode(h)), h)
    b = (vec(1000).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    np.testing.assert_array_equal(codecs.bf16().decode(codecs.bf16().encode(b)), b)


def test_fp16_matches_numpy_rounding_and_clamps():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-25, 14, 100_000))).astype(np.float32)
    x[:6] = [1e6, -7e4, 65519.0, 65520.0, 3e-8, -2.9e-8]
    ref = np.clip(x, -65504, 65504).astype(np.float16).astype(np.float32)
    d = codecs.fp16().decode(codecs.fp16().encode(x))
    np.testing.assert_array_equal(d, ref)
    assert d[:4].tolist() == [65504.0, -65504.0, 65504.0, 65504.0]


def test_bf16_rounds_to_nearest_even_and_clamps():
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(100_000) * np.exp(rng.uniform(-80, 80, 100_000))).astype(np.float32)
    x[:2] = [3.4e38, -3.4e38]  # would round to infinity
    u = x.view(np.uint32).astype(np.uint64)
    ref = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
    d = codecs.bf16().decode(codecs.bf16().encode(x))
    np.testing.assert_array_equal(d[2:], ref[2:])
    assert d[0] == np.float32(3.3895314e38) and d[1] == -d[0]


@pytest.mark.parametrize("codec", LOSSY, ids=repr)
def test_non_finite_values_stay_non_finite(codec):
    for bad in (np.nan, np.inf, -np.inf):
        x = vec(10_000)
        x[1234] = bad
        d = codec.decode(codec.encode(x))
        assert not np.isfinite(d).all(), (codec, bad)


def test_int8_blocks_zero_and_tiny():
    x = np.zeros(10_000, np.float32)
    x[5000:5010] = 1e-36  # absmax so small that 127 / absmax overflows float32
    c = codecs.int8()
    d = c.decode(c.encode(x))
    assert (d[:4096] == 0).all()
    within_bound(c, x, d)
    assert c.nbytes(10_000) == 12 + 10_000 + 3 * 4


def test_topk_selects_exactly_on_the_fast_and_the_fallback_paths():
    c = codecs.topk(0.01)
    for x in (
        vec(1_000_000, seed=3),  # sampled threshold
        vec(1_000_000, seed=4) * (np.arange(1_000_000) % 1000 == 0),  # mostly zeros: exact path
        np.ones(1_000_000, np.float32),  # all ties
    ):
        d = c.decode(c.encode(x))
        k = c.k(x.size)
        assert k == 10_000 and np.count_nonzero(d != 0) == min(k, np.count_nonzero(x))
        kth = np.sort(np.abs(x))[-k]
        assert (np.abs(d[d != 0]) >= kth).all()
        assert np.abs(x[d == 0]).max() <= kth


def test_topk_index_width_is_the_narrowest():
    c = codecs.topk(0.5)
    assert c.nbytes(256) == 12 + 128 * (4 + 1)
    assert c.nbytes(257) == 12 + 128 * (4 + 2)  # round(128.5) == 128
    assert c.nbytes(65_536) == 12 + 32_768 * (4 + 2)
    assert c.nbytes(65_537) == 12 + 32_768 * (4 + 4)


def test_sign_is_one_bit_a_value():
    c = codecs.sign()
    assert c.nbytes(8) == 12 + 4 + 1 and c.nbytes(9) == 12 + 4 + 2
    x = np.array([1.0, -3.0, 0.0, 2.0], np.float32)
    assert c.decode(c.encode(x)).tolist() == [1.5, -1.5, 1.5, 1.5]


# -- corrupt payloads ---------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL, ids=repr)
def test_truncated_or_padded_payloads_are_refused(codec):
    x = vec(5000)
    payload = bytes(codec.encode(x))
    for cut in sorted({0, 5, 11, 12, 13, len(payload) // 2, len(payload) - 1}):
        with pytest.raises(PayloadError, match="truncated"):
            codec.decode(payload[:cut], np.empty(5000, np.float32))
    with pytest.raises(PayloadError, match="1 bytes too many"):
        codec.decode(payload + b"\0", np.empty(5000, np.float32))


def test_foreign_and_corrupt_headers_are_refused():
    x = vec(5000)
    p = bytearray(codecs.fp16().encode(x))
    with pytest.raises(PayloadError, match=r"encoded by fp16, expected int8\(\)"):
        codecs.int8().decode(p)
    with pytest.raises(PayloadError, match="holds 5000 values, expected 4999"):
        codecs.fp16().decode(p, np.empty(4999, np.float32))
    bad = bytearray(p)
    bad[0] ^= 0xFF
    with pytest.raises(PayloadError, match="not a codec payload"):
        codecs.fp16().decode(bad)
    bad = bytearray(p)
    bad[1] = 99
    with pytest.raises(PayloadError, match="unknown codec id 99"):
        codecs.fp16().decode(bad)
    bad = bytearray(p)
    bad[2] = 1  # float64 values: only `none` sends those
    with pytest.raises(PayloadError, match="bad dtype code"):
        codecs.fp16().decode(bad)
    p8 = codecs.int8(block=64).encode(x)
    with pytest.raises(PayloadError, match="header parameter 6, expected 12"):
        codecs.int8().decode(p8)
    with pytest.raises(PayloadError, match="truncated"):  # another fraction, another length
        codecs.topk(0.02).decode(codecs.topk(0.01).encode(x))
    with pytest.raises(PayloadError, match="float64, expected float32"):
        codecs.none().decode(codecs.none().encode(x.astype(np.float64)), np.empty_like(x))
    with pytest.raises(PayloadError, match="must be bytes"):
        codecs.none().decode([1, 2, 3])


def test_corrupt_topk_indices_are_refused():
    c = codecs.topk(0.01)
    p = bytearray(c.encode(vec(5000)))
    k = c.k(5000)
    idx = np.frombuffer(p, np.uint16, k, 12)
    swapped = bytearray(p)
    view = np.frombuffer(swapped, np.uint16, k, 12)
    view[[0, 1]] = idx[[1, 0]]
    with pytest.raises(PayloadError, match="indices out of order"):
        c.decode(swapped)
    beyond = bytearray(p)
    np.frombuffer(beyond, np.uint16, k, 12)[-1] = 5000
    with pytest.raises(PayloadError, match="beyond n=5000"):
        c.decode(beyond)


# -- the protocol side: shards, policy, error feedback -----------------------------------


SEG = Segments.from_sizes(["a.b", "a.w", "c.b", "c.w"], [64, 4096, 10, 20_000])


def test_policy_small_leaves_travel_uncompressed():
    comp = compress.Compressor(codecs.topk(0.01), SEG, [(0, SEG.total)])
    assert [p.codec for p in comp.pieces[0]] == [codecs.none(), codecs.topk(0.01)] * 2
    p = codecs.size_adaptive(5000, small=codecs.int8(), large=codecs.sign())
    comp = compress.Compressor(p, SEG, [(0, SEG.total)])
    assert [c.codec for c in comp.pieces[0]] == [codecs.int8()] * 3 + [codecs.sign()]
    assert compress.is_identity(codecs.none())
    assert compress.is_identity(codecs.size_adaptive(10, large=codecs.none()))
    assert not compress.is_identity(p)


@pytest.mark.parametrize("codec", ALL, ids=repr)
def test_sharded_payloads_decode_like_unsharded(codec):
    g = vec(SEG.total, seed=5)
    cuts = [(0, 4160), (4160, 4170), (4170, SEG.total)]  # on leaf boundaries
    one = compress.Compressor(codec, SEG, [(0, SEG.total)])
    three = compress.Compressor(codec, SEG, cuts)
    (whole,), _ = one.encode(g)
    parts, _ = three.encode(g)
    assert [len(p) for p in parts] == [three.nbytes(k) for k in range(3)]
    joined = np.concatenate([three.decoder(k).decode(p) for k, p in enumerate(parts)])
    alone = compress.Decoder.for_shard(codec, SEG, cuts, 2)  # what a shard builds for itself
    np.testing.assert_array_equal(alone.decode(parts[2]), joined[4170:])
    np.testing.assert_array_equal(joined, one.decoder(0).decode(whole))
    # a leaf cut in two: each piece is compressed on its own, within the codec's bound
    cut = compress.Compressor(codec, SEG, [(0, 10_000), (10_000, SEG.total)])
    parts, _ = cut.encode(g)
    got = [cut.decoder(k).decode(p) for k, p in enumerate(parts)]
    assert [p.codec for p in cut.pieces[1]] == [cut.pieces[0][-1].codec]
    within_bound(cut.pieces[1][0].codec, g[10_000:], got[1])


def test_shard_payload_errors_name_the_shard_and_the_leaf():
    comp = compress.Compressor(codecs.int8(), SEG, [(0, 4160), (4160, SEG.total)])
    parts, _ = comp.encode(vec(SEG.total))
    dec = comp.decoder(1)
    with pytest.raises(PayloadError, match=r"shard 1, leaf 'c.w' \(int8\(\)\): truncated"):
        dec.decode(parts[1][:-1])
    with pytest.raises(PayloadError, match=r"shard 1: payload of .* \(2 bytes too many\)"):
        dec.decode(bytes(parts[1]) + b"xx")
    with pytest.raises(PayloadError, match=r"shard 1, leaf 'c.b' \(none\(\)\)"):
        dec.decode(parts[0])  # shard 0's payload sent to shard 1
    with pytest.raises(ValueError, match=r"expected a flat update of shape \(24170,\)"):
        comp.encode(np.zeros(10, np.float32))


@pytest.mark.parametrize(
    "codec",
    [
        codecs.topk(0.01),
        codecs.sign(),
        codecs.int8(error_feedback=True),
        codecs.int4(error_feedback=True),
    ],
    ids=repr,
)
def test_error_feedback_sends_everything_eventually(codec):
    comp = compress.Compressor(
        codecs.size_adaptive(0, large=codec), SEG, [(0, 5000), (5000, SEG.total)]
    )
    state = comp.init()
    assert isinstance(state, compress.Feedback) and not state.residual.any()
    sent = np.zeros(SEG.total, np.float64)
    total = np.zeros(SEG.total, np.float64)
    for step in range(30):
        g = vec(SEG.total, seed=100 + step)
        payloads, state = comp.encode(g, state)
        total += g
        for k, (lo, hi) in enumerate(comp.ranges):
            sent[lo:hi] += comp.decoder(k).decode(payloads[k])
        if step == 0:  # the residual is exactly what the first push dropped
            np.testing.assert_allclose(state.residual, g - sent, atol=1e-6)
    np.testing.assert_allclose(sent + state.residual, total, atol=2e-4)
    assert np.abs(state.residual).max() > 0  # it did drop something


def test_error_feedback_defaults_and_non_finite_updates():
    assert codecs.topk(0.1).error_feedback and codecs.sign().error_feedback
    assert not codecs.int8().error_feedback and not codecs.fp16().error_feedback
    assert compress.Compressor(codecs.fp16(), SEG, [(0, SEG.total)]).init() is None
    comp = compress.Compressor(codecs.topk(0.01), SEG, [(0, SEG.total)])
    _, state = comp.encode(vec(SEG.total))
    before = state.residual.copy()
    bad = vec(SEG.total, seed=9)
    bad[20_000] = np.nan
    (payload,), state = comp.encode(bad, state)
    np.testing.assert_array_equal(state.residual, before)  # a refused push takes nothing
    assert np.isnan(comp.decoder(0).decode(payload)).any()  # and the shard will refuse it
    no_ef = compress.Compressor(codecs.topk(0.01, error_feedback=False), SEG, [(0, SEG.total)])
    assert no_ef.encode(vec(SEG.total))[1] is None


def test_modeled_byte_counts_scale_every_piece():
    comp = compress.Compressor(codecs.topk(0.01), SEG, [(0, SEG.total)])
    big = comp.nbytes(0, scale=1000.0)
    expect = sum(p.codec.nbytes((p.stop - p.start) * 1000) for p in comp.pieces[0])
    assert big == expect
    assert comp.nbytes(0, np.float64) == comp.nbytes(0) + 74 * 4  # the `none` leaves double


# -- parsing, Job, config, CLI -----------------------------------------------------------


def test_parse_and_constructors_check_their_values():
    assert codecs.parse("topk:0.05") == codecs.topk(0.05)
    assert codecs.parse({"name": "topk", "fraction": 0.1, "error_feedback": False}) == codecs.topk(
        0.1, error_feedback=False
    )
    p = codecs.parse({"name": "size_adaptive", "threshold": 4096, "large": "int8"})
    assert p == codecs.size_adaptive(4096, large=codecs.int8())
    for bad, msg in [
        ("zip", "unknown codec 'zip'"),
        ("topk", "topk needs its fraction"),
        ("topk:2", r"fraction must be a number in \(0, 1\]"),
        ("int8:3", "takes no ':' argument"),
        ("size_adaptive", "size_adaptive needs a table"),
        ({"name": "int8", "block": 1000}, "block must be a power of two"),
        ({"name": "int4", "block": 6}, "int4: block must be a power of two"),
        ("int4:3", "takes no ':' argument"),
        ({"name": "topk", "fraction": 0.1, "k": 3}, "unexpected keyword argument 'k'"),
        ({"name": "sign", "error_feedback": "yes"}, "error_feedback must be True or False"),
        (3, "expected a codec name"),
    ]:
        with pytest.raises(ValueError, match=msg):
            codecs.parse(bad)
    with pytest.raises(TypeError, match="large must be a codec"):
        codecs.size_adaptive(10, large="topk")


def test_job_takes_a_codec_and_refuses_what_is_not_one():
    params = {"w": np.zeros(600, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(0.1), codec=sw.codecs.int8())
    assert job.config.codec == codecs.int8()
    assert sw.Job(params, optimizer=sw.optim.sgd(0.1)).config.codec == codecs.none()
    with pytest.raises(TypeError, match=r"codec must be a Policy \(e.g. sw.codecs.topk"):
        sw.Job(params, optimizer=sw.optim.sgd(0.1), codec="topk:0.01")
    with pytest.raises(TypeError, match="the function int8, not what it returns"):
        sw.Job(params, optimizer=sw.optim.sgd(0.1), codec=sw.codecs.int8)


DIGITS = {"name": "digits"}


def test_config_server_codec_and_the_cli_flag(tmp_path, capsys):
    sgd = {"name": "sgd", "lr": 0.1}
    sim = {"run": {"runtime": "sim"}}
    cfg = config.parse({"task": DIGITS, "optimizer": sgd, "server": {"codec": "int8"}, **sim})
    assert cfg.job.config.codec == codecs.int8()
    table = {"name": "size_adaptive", "threshold": 100, "large": "topk:0.1"}
    cfg = config.parse({"task": DIGITS, "optimizer": sgd, "server": {"codec": table}, **sim})
    assert cfg.job.config.codec == codecs.size_adaptive(100, large=codecs.topk(0.1))
    cfg = config.parse({"task": DIGITS, "optimizer": sgd, **sim}, codec="sign")
    assert cfg.job.config.codec == codecs.sign()
    for server, kw, key, msg in [
        ({"codec": "gzip"}, {}, "server.codec", "unknown codec 'gzip'"),
        ({"codec": 8}, {}, "server.codec", "expected a codec name"),
        ({}, {"codec": "topk:0"}, "--codec", "fraction must be a number"),
    ]:
        with pytest.raises(config.ConfigError, match=msg) as e:
            config.parse({"task": DIGITS, "optimizer": sgd, "server": server, **sim}, **kw)
        assert e.value.key == key
    ray = config.parse(
        {"task": DIGITS, "optimizer": sgd, "server": {"codec": "fp16"}, "run": {"runtime": "ray"}}
    )
    assert ray.job.config.codec == codecs.fp16() and ray.train["runtime"] == "ray"
    local = config.parse({"task": DIGITS, "optimizer": sgd, "server": {"codec": "fp16"}})
    assert local.job.config.codec == codecs.fp16() and local.train["runtime"] == "local"
    path = tmp_path / "job.toml"
    path.write_text(
        '[task]\nname = "least-squares"\nargs = { n = 64, d = 4 }\n'
        '[optimizer]\nname = "sgd"\nlr = 0.05\n[run]\nworkers = 2\nsteps = 40\nruntime = "sim"\n'
    )
    assert main(["train", str(path), "--codec", "bogus", "-q"]) == 2
    assert "--codec: unknown codec 'bogus'" in capsys.readouterr().err
    out = tmp_path / "run"
    assert main(["train", str(path), "--codec", "fp16", "--out", str(out), "-q"]) == 0
    assert (out / "metrics.jsonl").exists()


# -- the simulator ------------------------------------------------------------------------

SIM = SimConfig(compute=Fixed(0.01), network=Network(latency=1e-4, bandwidth=1.25e7))


def _digits_run(codec, shards=2, steps=600, model_bytes=None):
    task = tasks.get("digits")
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1), codec=codec, shards=shards)
    sim = dataclasses.replace(SIM, model_bytes=model_bytes)
    return job, job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=4,
        steps=steps,
        runtime=sw.Simulation(sim),
        evaluate=task.evaluate,
        metrics=sw.Metrics(every=1e9),
    )


def test_every_codec_trains_in_the_simulator_and_shrinks_the_modeled_bytes():
    job, base = _digits_run(codecs.none())
    raw = base.stats["sim"]["push_bytes"]
    assert raw == job.config.spec.nbytes
    floors = {"fp16": 1.9, "bf16": 1.9, "int8": 3.5, "int4": 6.5, "topk": 25.0, "sign": 15.0}
    every = [codecs.fp16(), codecs.bf16(), codecs.int8(), codecs.int4(), codecs.topk(0.01)]
    for codec in [*every, codecs.sign()]:
        job, r = _digits_run(codec)
        comp = compress.Compressor(codec, job.config.spec.segments, job.config.ranges)
        payloads, _ = comp.encode(job.config.init.copy())
        assert r.stats["sim"]["push_bytes"] == sum(len(p) for p in payloads)
        assert raw / r.stats["sim"]["push_bytes"] >= floors[codec.name], codec
        assert r.stats["applied"] == r.pushes == 600
        assert r.records[-1]["accuracy"] > 0.8, codec
        # a slower wire for the larger payload: the push takes longer without a codec
        assert r.stats["sim"]["push_time_mean"] < base.stats["sim"]["push_time_mean"]


def test_the_shards_apply_what_the_codec_delivers():
    """One worker, SGD with lr 1, topk(0.01) without feedback: every push moves the
    parameters on at most k entries per leaf, exactly as the codec decodes them."""
    task = tasks.get("least-squares", n=64, d=2000)
    codec = codecs.topk(0.01, error_feedback=False)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(1.0), codec=codec)
    r = job.train(task.loss_and_grad, data=task.batches, workers=1, steps=1, runtime="sim")
    moved = np.count_nonzero(r.flat != job.config.init)
    assert 1 <= moved <= codec.k(2000) == 20


def test_model_bytes_scale_the_payloads_exactly():
    job, r = _digits_run(codecs.topk(0.01), shards=1, steps=40, model_bytes=400_000_000)
    comp = compress.Compressor(codecs.topk(0.01), job.config.spec.segments, job.config.ranges)
    scale = 400_000_000 / job.config.spec.nbytes
    assert r.stats["sim"]["push_bytes"] == comp.nbytes(0, scale=scale)
    assert 0.01 * 400e6 < r.stats["sim"]["push_bytes"] < 0.04 * 400e6


def test_a_shard_decodes_its_payloads_and_refuses_corrupt_ones():
    """The protocol's shard with a decoder (ServerConfig.build_shard): it applies what its
    payload decodes to, counts the payload's bytes, and refuses what does not decode."""
    params = {"b": np.zeros(8, np.float32), "w": np.zeros(3000, np.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(1.0), codec=codecs.topk(0.1), shards=2)
    comp = job.config.compressor()
    lo, hi = job.config.ranges[1]
    shard = job.config.build_shard(1, job.config.init[lo:hi].copy(), workers=1)
    shard.join(0, 1)
    payloads, _ = comp.encode(vec(3008, seed=3))
    ack = shard.push(PushHeader(0, 0, 0, 1), payloads[1], verdict=Verdict())
    assert ack.ok and shard.stats.bytes_in == len(payloads[1]) == comp.nbytes(1)
    applied = -comp.decoder(1).decode(payloads[1])
    np.testing.assert_array_equal(shard.params, applied)
    for seq, bad, why in [
        (1, bytes(payloads[1])[:-1], "truncated"),
        (2, np.zeros(hi - lo, np.float32), "not a codec payload"),  # a raw vector
        (3, [1.0, 2.0], "a payload must be bytes, got list"),
    ]:
        ack = shard.push(PushHeader(0, seq, 1, 1), bad, verdict=Verdict())
        assert not ack.ok and ack.kind == "bad_payload" and why in ack.reason, ack
        assert "shard 1" in ack.reason
    np.testing.assert_array_equal(shard.params, applied)  # nothing applied
    assert shard.version == 1 and shard.stats.rejected == {"bad_payload": 3}
    assert shard.stats.bytes_in == comp.nbytes(1)


def report_stats(params, batch):
    """A gradient for "w"; the buffer "stats" reports the value 5 (its slot holds a value)."""
    return 0.0, {"stats": np.full(1000, 5.0, np.float32), "w": np.ones(1000, np.float32)}


def test_buffers_travel_exactly_whatever_the_codec():
    params = {"stats": np.zeros(1000, np.float32), "w": np.zeros(1000, np.float32)}
    job = sw.Job(
        params, optimizer=sw.optim.sgd(0.1), codec=codecs.topk(0.01), buffers=["stats"], shards=2
    )
    comp = job.config.compressor()
    codec_of = {p.name: p.codec for pieces in comp.pieces for p in pieces}
    assert codec_of == {"stats": codecs.none(), "w": codecs.topk(0.01)}
    r = job.train(report_stats, data=[[None]], workers=1, steps=3, runtime="sim")
    assert r.stats["applied"] == 3
    np.testing.assert_array_equal(r.params["stats"], np.full(1000, 5.0))  # not 1% of it
    assert np.count_nonzero(r.params["w"]) <= 3 * codecs.topk(0.01).k(1000)


@pytest.mark.parametrize("module", [codecs, compress])
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_header_is_twelve_bytes():
    assert codecs.HEADER.size == 12 == struct.calcsize("<BBBBQ")


# -- int4 against a hand-written reference ---------------------------------------------------


def int4_reference(x, block):
    """Int4's rule written out in float64 and plain Python: per block, scale = absmax / 7,
    level = round(x / scale) (half to even) clipped to [-7, 7]; the packed bytes, value
    2i in the low nibble of byte i as level + 8, a 0 high nibble after an odd last value."""
    scales, levels = [], []
    for lo in range(0, x.size, block):
        xs = x[lo : lo + block].astype(np.float64)
        top = float(np.abs(xs).max())
        scale = np.float32(top / 7)
        scales.append(scale)
        inv = 7 / top if top else 0.0
        levels += [int(min(max(round(v * inv), -7), 7)) for v in xs]
    codes = [q + 8 for q in levels] + ([0] if len(levels) % 2 else [])
    packed = bytes(codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2))
    return np.array(scales, np.float32), np.array(levels), packed


@pytest.mark.parametrize("n, block", [(1, 1), (2, 2), (7, 4), (64, 64), (129, 32), (1001, 256)])
def test_int4_matches_a_hand_written_reference(n, block):
    x = vec(n, seed=n) * np.float32(3.0)
    c = codecs.int4(block=block)
    payload = bytes(c.encode(x))
    assert len(payload) == c.nbytes(n) == 12 + (n + 1) // 2 + 4 * -(-n // block)
    assert payload[:12] == codecs.HEADER.pack(codecs.MAGIC, 6, 0, block.bit_length() - 1, n)
    blocks = -(-n // block)
    scales, levels, packed = int4_reference(x, block)
    got_scales = np.frombuffer(payload, np.float32, blocks, 12)
    np.testing.assert_allclose(got_scales, scales, rtol=2e-7)
    # the levels agree except where x / scale is within float32 rounding of a half
    got_packed = payload[12 + 4 * blocks :]
    assert len(got_packed) == len(packed)
    got = np.array([(got_packed[i // 2] >> 4 * (i % 2)) & 15 for i in range(n)]) - 8
    near_half = np.abs(np.abs(x / np.repeat(scales, block)[:n]) % 1 - 0.5) < 1e-5
    assert ((got == levels) | near_half).all()
    if n % 2:
        assert got_packed[-1] >> 4 == 0  # the padding nibble
    d = c.decode(payload)
    np.testing.assert_array_equal(d, got.astype(np.float32) * np.repeat(got_scales, block)[:n])
    err = np.abs(d.astype(np.float64) - x)
    for b in range(blocks):  # at most half of the block's step (its scale)
        assert err[b * block : (b + 1) * block].max() <= got_scales[b] / 2 * (1 + 1e-4)


def test_int4_round_trips_its_levels_exactly_and_zeros():
    step = np.float32(0.25)  # a power of two: 7 * step and step * k are exact in float32
    x = np.array([k * step for k in range(-7, 8)] * 3 + [0.0], np.float32)  # 46 values
    for c in (codecs.int4(), codecs.int4(block=16), codecs.int4(block=1)):
        np.testing.assert_array_equal(c.decode(c.encode(x)), x)
    odd = x[:45]
    np.testing.assert_array_equal(codecs.int4().decode(codecs.int4().encode(odd)), odd)
    zeros = np.zeros(301, np.float32)
    d = codecs.int4(block=64).decode(codecs.int4(block=64).encode(zeros))
    assert (d == 0).all() and not np.signbit(d).any()
    tiny = np.zeros(1000, np.float32)
    tiny[700:705] = 1e-36  # absmax so small that 7 / absmax overflows float32
    c = codecs.int4()
    d = c.decode(c.encode(tiny))
    assert (d[:512] == 0).all() and (d[768:] == 0).all()
    within_bound(c, tiny, d)
    assert codecs.int4(block=64).decode(codecs.int4(block=64).encode(np.ones(1, np.float32))) == 1


def test_int4_refuses_invalid_codes_and_foreign_payloads():
    x = vec(101)
    c = codecs.int4(block=32)
    p = bytearray(c.encode(x))
    body = 12 + 4 * 4
    bad = bytearray(p)
    bad[body] &= 0xF0  # value 0's code 0: level -8, never written
    with pytest.raises(PayloadError, match="1 invalid 4-bit codes"):
        c.decode(bad)
    bad = bytearray(p)
    bad[-1] |= 0x30  # the padding nibble after the 101st value
    with pytest.raises(PayloadError, match="invalid 4-bit codes"):
        c.decode(bad)
    with pytest.raises(PayloadError, match=r"header parameter 5, expected 8"):
        codecs.int4().decode(p)
    with pytest.raises(PayloadError, match=r"encoded by int4, expected int8"):
        codecs.int8().decode(p)
    with pytest.raises(PayloadError, match=r"encoded by int8, expected int4"):
        codecs.int4().decode(codecs.int8().encode(x))
    assert repr(codecs.int4(block=32, error_feedback=True)) == "int4(block=32, error_feedback=True)"
    assert codecs.parse("int4") == codecs.int4() and codecs.int4().error_feedback is False
    assert codecs.parse({"name": "int4", "block": 64}) == codecs.int4(block=64)


def test_the_warm_up_loads_the_kernels_of_a_large_pushs_path():
    """Top-k picks a large vector's values through a sampled threshold and a compiled
    kernel (from 64k values on); the warm-up, run before the clock starts, loads it too
    (in a fresh process: this one may have loaded it already)."""
    import subprocess
    import sys

    check = (
        "import types, stalewise as sw\n"
        "from stalewise import _codec_kernels as K\n"
        "from stalewise.protocol.compress import warm_up\n"
        "warm_up([types.SimpleNamespace(codec=sw.codecs.topk(0.1))])\n"
        "print(len(K.topk_candidates.signatures))\n"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()  # fmt: skip
    assert out == ["1"], out
