"""Segment pushes: a push carries only its leaf pieces that are not all zero.

The compressor's segment payload against the dense one (same values decoded,
zeros elsewhere, fewer bytes, exactly ``sent_nbytes``), error feedback kept
for the pieces not sent, corrupt segment headers refused by the shard with
nothing changed, and streaming DiLoCo's bytes: the simulator charges exactly
the bytes a local run's shards receive, a push costing its fragment.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal

import stalewise as sw
from stalewise import codecs, optim
from stalewise.codecs import PayloadError
from stalewise.protocol.compress import SEGMENTS, Compressor, segment_nbytes
from stalewise.protocol.messages import PushHeader
from stalewise.protocol.shard import Shard
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed
from stalewise.segments import Segments
from stalewise.strategies import streaming_diloco

SIZES = {"a": 1500, "b": 700, "c": 3000}  # int4 on every leaf (> SMALL_LEAF)


def _seg() -> Segments:
    return Segments.from_sizes(list(SIZES), list(SIZES.values()))


def _update(zero: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    g = rng.standard_normal(sum(SIZES.values())).astype(np.float32)
    seg = _seg()
    i = seg.names.index(zero)
    g[int(seg.offsets[i]) : int(seg.offsets[i] + seg.sizes[i])] = 0.0
    return g


@pytest.mark.parametrize("codec", [codecs.int4(), codecs.int8()], ids=["int4", "int8"])
def test_a_segment_payload_decodes_to_the_dense_values_with_fewer_bytes(codec):
    seg, ranges = _seg(), [(0, 2000), (2000, 5200)]  # "b" cut between the shards
    comp = Compressor(codec, seg, ranges)
    g = _update("b")
    bufs = [bytearray(comp.nbytes(k)) for k in range(2)]
    comp.encode_into(g, bufs)
    for k, (lo, hi) in enumerate(ranges):
        dec = comp.decoder(k)
        got = dec.decode(bufs[k])
        used = dec.length(bufs[k])
        assert used == comp.sent_nbytes(k) < comp.nbytes(k)
        # the pieces sent, decoded as the codec decodes them alone; zeros for "b"
        sent = [comp.pieces[k][i] for i in comp.sent[k]]
        assert [p.name for p in sent] == (["a"] if k == 0 else ["c"])
        want = np.zeros(hi - lo, np.float32)
        for p in sent:
            x = g[p.start : p.stop]
            p.codec.decode(p.codec.encode(x), want[p.start - lo : p.stop - lo])
        assert_array_equal(got, want)
        b = slice(max(1500, lo) - lo, min(2200, hi) - lo)
        assert not got[b].any()
        want = segment_nbytes([p.codec.nbytes(p.stop - p.start) for p in sent])
        assert used == want
        # in a buffer of the dense size (shared memory): the tail is not read
        assert_array_equal(dec.decode(bytes(bufs[k][:used])), got)


def test_a_push_whose_shard_slice_is_all_zero_is_a_header_only_payload():
    seg = _seg()
    comp = Compressor(codecs.int4(), seg, [(0, 1500), (1500, 5200)])
    g = np.zeros(5200, np.float32)
    g[:1500] = 1.0
    bufs = [bytearray(comp.nbytes(k)) for k in range(2)]
    comp.encode_into(g, bufs)
    assert comp.sent == [None, []]  # shard 0 dense (its one piece is sent), shard 1 nothing
    assert comp.decoder(1).length(bufs[1]) == SEGMENTS.size == 12
    assert not comp.decoder(1).decode(bufs[1]).any()


def test_a_piece_not_sent_keeps_its_error_feedback_residual():
    seg = _seg()
    comp = Compressor(codecs.int4(error_feedback=True), seg, [(0, 5200)])
    bufs = [bytearray(comp.nbytes(0))]
    state = comp.encode_into(_update("a"), bufs)  # "b" and "c" leave residuals
    assert state.residual[1500:].any()
    before = state.residual.copy()
    out = comp.init()
    new = comp.encode_into(_update("b") * (np.arange(5200) < 1500), bufs, state, out=out)
    # only "a" was sent: "b" and "c" keep their residuals as they were
    assert comp.sent == [[0]]
    assert_array_equal(new.residual[1500:], before[1500:])
    assert new.residual[:1500].any()
    assert_array_equal(state.residual, before)  # the committed residual untouched


@pytest.mark.parametrize(
    "corrupt, msg",
    [
        (lambda b: b.__setitem__(slice(12, 16), (9).to_bytes(4, "little")), "increasing indices"),
        (lambda b: b.__setitem__(slice(8, 12), (10**6).to_bytes(4, "little")), "bytes"),
        (lambda b: b.__setitem__(slice(4, 8), (7).to_bytes(4, "little")), "pieces"),
    ],
    ids=["bad-index", "bad-length", "bad-count"],
)
def test_a_corrupt_segment_payload_is_refused_and_changes_nothing(corrupt, msg):
    seg = _seg()
    comp = Compressor(codecs.int4(), seg, [(0, 5200)])
    buf = bytearray(comp.nbytes(0))
    comp.encode_into(_update("b"), [buf])
    bad = bytearray(buf)
    corrupt(bad)
    with pytest.raises(PayloadError, match=msg):
        comp.decoder(0).decode(bad)
    params = np.zeros(5200, np.float32)
    shard = Shard(params, seg, optim.sgd(1.0), workers=1, decoder=comp.decoder(0))
    shard.join(0, incarnation=1)
    ack = shard.push(PushHeader(0, 0, 0, 1), bad)
    assert not ack.ok and ack.kind == "bad_payload" and msg in ack.reason
    assert shard.version == 0 and not params.any() and shard.stats.bytes_in == 0
    ack = shard.push(PushHeader(0, 1, 0, 1), buf)  # the good one: its own length counted
    assert ack.ok and shard.stats.bytes_in == comp.sent_nbytes(0) < len(buf)
    assert not params[1500:2200].any() and params[:1500].any()


# -- streaming DiLoCo: the simulator counts the bytes a local run sends ------------------------


def init_params() -> dict:
    return {k: np.full(n, 1.0, np.float32) for k, n in SIZES.items()}


def loss_and_grad(params, batch):  # module level: the local runtime's workers import it
    g = {k: v - batch * (i + 1) for i, (k, v) in enumerate(params.items())}
    return float(sum((x * x).sum() for x in g.values())) / 2, g


def data(worker, workers):
    rng = np.random.default_rng(worker)
    while True:
        yield np.float32(0.5 + 0.1 * rng.standard_normal())


def _job(runtime, **kw):
    s = streaming_diloco(local_steps=6, inner=sw.optim.sgd(0.05), fragments=3, delay=1)
    job = sw.Job(init_params(), strategy=s, consistency=sw.BSP(), shards=2, codec=codecs.int4())
    return job.train(loss_and_grad, data=data, workers=2, steps=18, runtime=runtime, **kw)


def test_streaming_pushes_cost_their_fragment_and_the_simulator_counts_them_exactly(no_leaks):
    sim = _job(sw.Simulation(SimConfig(compute=Fixed(0.01))))
    local = _job("local", timeouts=sw.Timeouts(total=120))
    assert sim.pushes == local.pushes == 18
    dense = sim.stats["sim"]["push_bytes"]  # one push, every piece: DiLoCo's
    assert local.stats["bytes_in"] == sim.stats["bytes_in"] == sim.stats["sim"]["pushed_bytes"]
    # fragments "a", "b", "c" in turn (sizes 1500, 700, 3000 of 5200): each worker pushes each 3 times
    assert local.stats["bytes_in"] < 18 * dense * 0.45
    assert local.stats["bytes_in"] == pytest.approx(18 * dense / 3, rel=0.05)
