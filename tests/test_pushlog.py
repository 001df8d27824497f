"""protocol/pushlog.py: a shard's journal since a checkpoint replays to the same shard, bit
for bit; a torn last entry is dropped, a garbled one named in one line."""

import io
import json
import logging
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from test_shard_state import CONSISTENCY, OPTIMIZERS, SEGMENTS, STALENESS, assert_same_state

from stalewise import codecs
from stalewise.consistency import Hybrid
from stalewise.protocol import PushHeader, Shard, Verdict, commit, compress, pushlog

CONSISTENCY = CONSISTENCY | {"hybrid": lambda: Hybrid(tolerance=1.5)}
KINDS = ["push"] * 10 + ["dup", "gap", "bad", "refused", "old", "leave", "join", "admit"]
KINDS += ["retire", "expire", "resume", "depart", "deliver", "pull", "pull", "observe", "served"]
OPS = hs.tuples(hs.sampled_from(KINDS), *[hs.integers(0, 3)] * 2, hs.integers(0, 2**16))


class Scenario:
    """Makes shards alike and sends one of them the calls a runtime would."""

    def __init__(self, opt, consistency, staleness, workers, codec, dtype):
        self.config = opt, consistency, staleness, workers
        self.comp = None
        if codec:
            self.comp = compress.Compressor(codecs.int8(), SEGMENTS, [(0, SEGMENTS.total)])
        self.dtype, self.now = dtype, 0.0

    def shard(self, seed):
        opt, consistency, staleness, workers = self.config
        params = np.random.default_rng(seed).standard_normal(SEGMENTS.total).astype(self.dtype)
        return Shard(
            params,
            SEGMENTS,
            OPTIMIZERS[opt](),
            workers=workers,
            consistency=CONSISTENCY[consistency](),
            staleness=STALENESS[staleness](),
            decoder=None if self.comp is None else self.comp.decoder(0),
        )

    def payload(self, seed, bad=False):
        g = np.random.default_rng(seed).standard_normal(SEGMENTS.total).astype(self.dtype)
        if self.comp is None:
            g[seed % g.size] = np.nan if bad else g[seed % g.size]
            return g
        data = bytes(self.comp.encode(g)[0][0])
        return data[: seed % len(data)] if bad else data

    def call(self, s, op):
        kind, w, back, seed = op
        self.now += 0.001 * (1 + seed % 7)
        joined = [v for v in range(s.workers) if s.live[v] and s.incarnation[v]]
        w = joined[w % len(joined)] if joined and kind != "old" else w % s.workers
        inc, seq = int(s.incarnation[w]), int(s.next_seq[w])
        seq = {"dup": seq - 1 - back % 2, "gap": seq + 1, "old": seq}.get(kind, seq)
        header = PushHeader(w, max(seq, 0), max(0, s.version - back), inc - (kind == "old"))
        payload = self.payload(seed, bad=kind == "bad")
        verdict = [None, Verdict()][seed % 2]
        if kind == "refused":
            verdict = Verdict([commit.NOT_FINITE, commit.TOO_STALE][seed % 2], back)
        if kind in ("push", "dup", "gap", "bad", "refused", "old"):
            return s.push(header, payload, verdict=verdict, now=self.now)
        if kind in ("join", "admit"):
            return getattr(s, kind)(w, inc + 1)
        if kind in ("leave", "retire"):
            return getattr(s, kind)(w)
        if kind in ("depart", "deliver"):
            committed = None if kind == "depart" and back == 0 else (header, payload, Verdict())
            return getattr(s, kind)(w, inc - (back == 3), committed)
        if kind in ("expire", "resume"):
            return getattr(s, {"expire": "expire_unstarted"}.get(kind, kind))()
        if kind == "served":  # a delta pull's payload
            return s.served(seed)
        out = np.empty_like(s.params) if back else None
        return s.pull(None if kind == "observe" else w, out, now=self.now)


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    opt=hs.sampled_from(["adam", "lamb", "sgd", "clip_adam"]),
    consistency=hs.sampled_from(sorted(CONSISTENCY)),
    staleness=hs.sampled_from(sorted(STALENESS)),
    workers=hs.integers(1, 4),
    codec=hs.booleans(),
    dtype=hs.sampled_from([np.float32, np.float64]),
    ops=hs.lists(OPS, max_size=80),
    split=hs.floats(0, 1),
)
def test_a_checkpoint_and_the_journal_since_replay_bit_for_bit(
    opt, consistency, staleness, workers, codec, dtype, ops, split
):
    run = Scenario(opt, consistency, staleness, workers, codec, np.float32 if codec else dtype)
    a = run.shard(seed=1)
    for w in range(workers):
        a.join(w, 1)
    cut = int(split * len(ops))
    for op in ops[:cut]:
        run.call(a, op)
    state, chunks = a.state_dict(), []
    a.journal = chunks.extend
    answers = [run.call(a, op) for op in ops[cut:]]
    a.journal = None

    b = run.shard(seed=2)
    b.load_state_dict(state)
    entries = pushlog.decode(b"".join(chunks))
    assert len(entries) == len(ops) - cut  # one per call, none for what a call calls
    assert pushlog.replay(b, entries) == answers  # acks, expired workers, versions
    assert_same_state(a.state_dict(), b.state_dict())  # params, optimizer state, clocks, stats
    assert (a.min_clock(), a.synchronous) == (b.min_clock(), b.synchronous)


def journal_of_pushes(n=3):
    run = Scenario("adam", "asp", "dc", 2, False, np.float32)
    a, chunks = run.shard(seed=1), []
    a.journal = chunks.extend
    a.join(0, 1)
    for seq in range(n):
        a.pull(0)
        a.push(PushHeader(0, seq, a.version, 1), run.payload(seq))
    return run, a, b"".join(chunks)


def test_a_torn_last_entry_is_dropped_and_the_rest_replays(caplog):
    run, a, data = journal_of_pushes()
    whole = pushlog.decode(data)
    assert [e.op for e in whole] == ["join"] + ["pull", "push"] * 3
    assert isinstance(whole[-1].payload, np.ndarray) and whole[-1].payload.flags.writeable
    for cut in (1, 5, 20, 21, len(data) - 529 - 1):  # entry 6 starts at byte 529
        with caplog.at_level(logging.WARNING):
            torn = pushlog.decode(data[:-cut], where="log-0")
        assert len(torn) == len(whole) - 1
        assert "log-0: entry 6 at byte" in caplog.text and "torn" in caplog.text
    b = run.shard(seed=1)
    pushlog.replay(b, torn)
    assert b.version == a.version - 1


def entry(fields, payload=b""):
    header = json.dumps(fields).encode()
    return struct.pack("<4sII", b"SWJ2", len(header), zlib.crc32(header)) + header + payload


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"SWJ3" + bytes(20), "not a journal entry (magic b'SWJ3')"),
        (b"SWJ1" + bytes(20), "not a journal entry of an earlier stalewise, whose joins"),
        (struct.pack("<4sII", b"SWJ2", 1 << 20, 0) + bytes(9), "header of 1048576 bytes"),
        (entry({"op": "leave", "worker": 0})[:-2] + b"1}", "header checksum mismatch"),
        (entry({"op": "fork"}), "'op': expected one of push, pull"),
        (entry({"op": "join", "worker": 0}), "'incarnation': missing"),
        (entry({"op": "leave", "worker": "0"}), "'worker': 0 is not valid here"),
        (entry({"op": "leave", "worker": 0, "x": 1}), "'x': unknown field"),
        (entry({"op": "resume", "n": 8, "sum": 0, "dtype": "|O", "shape": [1]}), "'dtype'"),
        (
            entry({"op": "resume", "n": 9, "sum": 0, "dtype": "<f4", "shape": [2]}, bytes(9)),
            "'shape': [2] does not hold 9 bytes of <f4",
        ),
        (entry({"op": "resume", "n": 8, "sum": 1, "dtype": "bytes"}, bytes(8)), "'sum'"),
        (entry({"op": "resume", "n": 1 << 31, "sum": 1, "dtype": "bytes"}), "more than 4096"),
    ],
)
def test_a_garbled_journal_is_named_in_one_line(data, problem):
    with pytest.raises(pushlog.LogError) as e:
        pushlog.decode(entry({"op": "resume"}) + data, max_payload=4096, where="log-0")
    assert str(e.value).startswith("log-0: entry 1 at byte 28: ") and "\n" not in str(e.value)
    assert problem in str(e.value)


def test_a_journal_that_does_not_fit_the_shard_is_refused():
    data = journal_of_pushes()[2]
    other = Scenario("adam", "asp", "dc", 1, False, np.float32).shard(seed=0)
    other.join(0, 1)  # incarnation 1 again: not newer
    with pytest.raises(
        pushlog.LogError, match=r"^journal: entry 0 \(join\): worker 0: incarnation 1"
    ):
        pushlog.replay(other, pushlog.decode(data))


def test_a_shard_without_a_journal_records_nothing_and_a_raising_call_is_not_recorded():
    run = Scenario("sgd", "asp", "constant", 1, False, np.float32)
    a, chunks = run.shard(seed=1), []
    a.join(0, 1)
    a.journal = chunks.extend
    with pytest.raises(ValueError, match="unknown worker 5"):
        a.leave(5)
    assert chunks == []


def test_a_read_without_payloads_gives_the_same_entries_and_drops_a_torn_one():
    """``read(payloads=False)`` skips each payload (None) and finds the same entries, a torn
    last one dropped as a whole read drops it."""
    from stalewise import optim, segments

    shard = Shard(np.zeros(4, np.float32), segments.Segments.single(4), optim.sgd(1.0), workers=1)
    data = bytearray()
    shard.journal = lambda buffers: data.extend(b"".join(buffers))
    shard.join(0, 1)
    for seq in range(3):
        shard.push(PushHeader(0, seq, seq, 1), np.full(4, seq, np.float32))
    for cut in (len(data), len(data) - 3):
        whole = pushlog.decode(bytes(data[:cut]))
        skipped = list(pushlog.read(io.BytesIO(bytes(data[:cut])), max_payload=64, payloads=False))
        assert [e.op for e in skipped] == [e.op for e in whole]
        assert [e.fields.get("header") for e in skipped] == [e.fields.get("header") for e in whole]
        assert all(e.payload is None for e in skipped)
    assert [e.op for e in whole] == ["join", "push", "push"]  # the torn push dropped
