"""A shard survives whatever a worker writes into its pipe (the wire format is binary records).

Each case writes bytes into the pipe of a worker incarnation (the "attacker",
worker 0) of a real local server, then checks that the shard cut it off (or
served it, if the bytes were valid messages), changed no parameter, unpickled
nothing, and still serves an honest worker (worker 1).
"""

import contextlib
import os
import pickle
import select
import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stalewise as sw
from stalewise import ServerClosed
from stalewise.protocol import Ack
from stalewise.runtime.local import wire

FRAME = struct.Struct("!i")
SETTLE = 10.0  # seconds: the longest a shard may take to cut off a worker (PARTIAL_TIMEOUT is 1 s)


@pytest.fixture(scope="class")
def server():
    job = sw.Job(
        {"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)},
        optimizer=sw.optim.sgd(1.0),
        shards=2,
    )
    with job.serve(workers=2) as srv:
        honest = srv.client(1)
        honest.pull(timeout=30)
        srv.honest = honest
        yield srv
        honest.close()


def ones():
    return {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}


def replies_until_closed(conn, timeout=SETTLE) -> list[tuple]:
    """Reads a pipe until the shard closes it; the messages it sent, decoded."""
    fd, got = conn.fileno(), bytearray()
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"the shard did not close the pipe within {timeout} s"
        if select.select([fd], [], [], left)[0]:
            try:
                data = os.read(fd, 1 << 16)
            except ConnectionResetError:
                data = b""
            if not data:
                break
            got += data
    reader = wire.FrameReader(wire.MAX_REPLY)
    return [wire.decode_reply(body) for body in reader.feed(bytes(got))]


def attack(server, k: int, data: bytes, *, end: bytes = b"") -> tuple[list[tuple], float]:
    """A new incarnation of worker 0 writes ``data`` (then ``end``) raw into its pipe to
    shard ``k`` and waits until the shard cuts it off; returns the replies and the wait."""
    attacker = server.client(0)
    try:
        conn = attacker._conns[k]
        t0 = time.monotonic()
        with contextlib.suppress(BrokenPipeError):  # cut off in the middle of the write: fine
            conn._send(data + end)  # raw bytes, no framing of ours
        replies = replies_until_closed(conn)
        return replies, time.monotonic() - t0
    finally:
        attacker.close()


def error_of(replies) -> str:
    errors = [r[1] for r in replies if r[0] == "error"]
    assert len(errors) == 1, replies
    return errors[0]


def check_unharmed(server, before) -> None:
    """No parameter changed, and the honest worker is served at once by both shards."""
    now = server.pull(timeout=10)
    for leaf in ("a", "b"):
        assert now[leaf].tobytes() == before[leaf].tobytes()
    honest = server.honest
    t0 = time.monotonic()
    honest.pull(timeout=10)
    honest.push(ones())
    result = honest.wait(timeout=10)
    assert result.status == "applied", result
    assert time.monotonic() - t0 < 5
    assert all(p.is_alive() for p in server._procs)


def frames(draw_kind, draw_body):
    return st.tuples(draw_kind, draw_body).map(lambda kb: wire.frame(bytes([kb[0]]) + kb[1]))


# random bytes, and streams of frames that look like messages (known kinds, odd sizes)
JUNK = st.one_of(
    st.binary(min_size=1, max_size=300),
    st.lists(
        frames(
            st.sampled_from([0x01, 0x02, 0x03, 0x11, 0x21, 0x24, 0x80, 0xFF]),
            st.binary(max_size=70),
        ),
        min_size=1,
        max_size=5,
    ).map(b"".join),
    st.tuples(
        st.one_of(st.integers(0, 80), st.integers(-(2**31), 2**31 - 1)), st.binary(max_size=20)
    ).map(lambda nb: FRAME.pack(nb[0]) + nb[1]),
)
# A frame of an unknown kind ends every stream: whatever the junk left half-read, the
# shard ends up cutting the attacker off (at the latest when its message stays
# incomplete), so the test knows when every byte has been handled.
TAIL = wire.frame(b"\xff")


class Marker:
    """Unpickling this makes a directory: the evidence that something unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.makedirs, (self.path,))


class TestOneServer:
    """Every case against one server (started once): a new attacker incarnation each time."""

    @settings(max_examples=40, deadline=None)
    @given(data=JUNK, k=st.integers(0, 1))
    def test_random_bytes_never_crash_or_hang_a_shard_nor_change_the_params(self, server, data, k):
        before = server.pull(timeout=10)
        replies, took = attack(server, k, data, end=TAIL)
        assert took < SETTLE
        assert all(r[0] in ("pulled", "error", "ack") for r in replies), replies
        assert [r for r in replies if r[0] == "ack"] == []  # the attacker committed nothing
        check_unharmed(server, before)

    def test_a_length_header_without_a_body_is_cut_off_and_blocks_no_one(self, server):
        before = server.pull(timeout=10)
        attacker = server.client(0)
        try:
            attacker._conns[0]._send(FRAME.pack(9))  # says 9 bytes follow; none ever does
            honest = server.honest
            fd = attacker._conns[0].fileno()
            for n in range(3):  # meanwhile the shard serves the others as usual
                honest.push(ones())
                assert honest.wait(timeout=10).status == "applied"
                if n == 0:
                    # the shard cuts a worker off by writing an error into its pipe, then
                    # closing it; had it waited for the missing body (1 s) before serving
                    # this push, the attacker's pipe would already be readable
                    assert not select.select([fd], [], [], 0)[0], "served only after cut-off"
            replies = replies_until_closed(attacker._conns[0])
        finally:
            attacker.close()
        assert "sent an incomplete message (4 bytes) and nothing more for 1 s" in error_of(replies)
        after = server.pull(timeout=10)
        np.testing.assert_array_equal(after["b"], before["b"] - 3.0)

    @pytest.mark.parametrize(
        ("data", "reason"),
        [
            (b"\x00\x00", "sent an incomplete message (2 bytes)"),  # a truncated header
            (wire.frame(b"\x01\x00\x00"), "kind 0x01 with the wrong size (3 bytes)"),
            (
                FRAME.pack(1_000_000) + b"x" * 100,
                "oversize message (1000000 bytes, the most is 64)",
            ),
            (FRAME.pack(-1) + struct.pack("!Q", 10), "a bad length header (-1)"),
            (wire.frame(b""), "an empty message"),
            (wire.frame(b"\x7f"), "a message of unknown kind 0x7f (1 bytes)"),
            (wire.frame(wire.ack(Ack(1, 0, True, None, 0, 0))), "unknown kind 0x11"),
            (wire.frame(wire.push(5)), "sent push 5, which has no committed record"),
            (wire.frame(wire.push(-1)), "sent push -1, which has no committed record"),
        ],
        ids=[
            "truncated-header",
            "wrong-size",
            "oversize",
            "negative-length",
            "empty",
            "unknown-kind",
            "a-reply-kind",
            "push-without-record",
            "negative-seq",
        ],
    )
    def test_a_malformed_message_disconnects_its_sender_only(self, server, data, reason):
        before = server.pull(timeout=10)
        replies, took = attack(server, 1, data)
        text = error_of(replies)
        assert text.startswith("disconnected worker 0 (") and reason in text, text
        assert took < SETTLE
        check_unharmed(server, before)

    def test_a_pickle_is_not_a_message_and_is_never_unpickled(self, server):
        path = f"/tmp/swp{os.getpid()}"  # short: the pickle fits a worker message's size
        body = pickle.dumps(Marker(path), protocol=pickle.HIGHEST_PROTOCOL)
        assert len(body) <= wire.MAX_WORKER_MESSAGE  # so it reaches the decoder
        before = server.pull(timeout=10)
        try:
            replies, _ = attack(server, 0, wire.frame(body))
            assert "unknown kind 0x80" in error_of(replies)
            # as multiprocessing's Connection.send would send it (the old wire format)
            replies, _ = attack(server, 1, wire.frame(pickle.dumps(("push", Marker(path)))))
            assert "disconnected worker 0" in error_of(replies)
            assert not os.path.exists(path)
        finally:
            if os.path.isdir(path):
                os.rmdir(path)
        check_unharmed(server, before)

    def test_a_push_in_another_workers_name_is_refused(self, server):
        """Worker 1 has committed push n; worker 0 announcing "push n" on its pipe is cut off
        (the shard reads worker 0's record, never worker 1's), and worker 1's push is applied
        exactly once, when worker 1 announces it."""
        honest = server.honest
        honest.wait(timeout=10)
        honest.push_buffer[:] = 1.0
        seq = honest._commit()
        before = server.pull(timeout=10)
        replies, _ = attack(server, 0, wire.frame(wire.push(seq)))
        assert f"sent push {seq}, which has no committed record" in error_of(replies)
        now = server.pull(timeout=10)
        assert now["a"].tobytes() == before["a"].tobytes()
        for c in honest._conns:
            c.send_bytes(wire.push(seq))
        honest._sender.committed()
        honest._acks_due = [True, True]
        assert honest.wait(timeout=10).status == "applied"
        np.testing.assert_array_equal(server.pull(timeout=10)["a"], before["a"] - 1.0)
        check_unharmed(server, server.pull(timeout=10))

    def test_a_worker_that_never_reads_its_replies_is_cut_off(self, server):
        """A flood of duplicate announcements fills the reply pipe: the shard does not block."""
        attacker = server.client(0)
        try:
            attacker.pull(timeout=10)
            attacker.push({"a": np.zeros(4, np.float32), "b": np.zeros(4, np.float32)})
            attacker.wait(timeout=10)
            before = server.pull(timeout=10)
            flood = wire.frame(wire.push(0)) * 20_000  # each answered by a duplicate ack
            deadline = time.monotonic() + SETTLE
            conn = attacker._conns[0]
            os.set_blocking(conn.fileno(), False)
            sent = 0
            while sent < len(flood) and time.monotonic() < deadline:
                try:
                    sent += os.write(conn.fileno(), flood[sent : sent + 65536])
                except BlockingIOError:
                    time.sleep(0.01)
                except (BrokenPipeError, ConnectionResetError):
                    break
            os.set_blocking(conn.fileno(), True)
            replies = replies_until_closed(conn)
        finally:
            attacker.close()
        # cut off once its reply pipe was full, long before the flood was answered (the error
        # reply itself may not fit any more, the shard's log says it)
        acks = [r[1] for r in replies if r[0] == "ack"]
        assert 0 < len(acks) < 20_000 and all(a.duplicate for a in acks)
        assert {r[0] for r in replies} <= {"ack", "error"}
        check_unharmed(server, before)


def test_the_cut_is_logged_naming_the_worker_and_the_shard(no_leaks, capfd):
    job = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        client.pull(timeout=10)
        client._conns[0].send_bytes(b"\x42")
        with pytest.raises(ServerClosed, match=r"shard 0: disconnected worker 0 \(1\): sent a "):
            client._take(0, "ack", 10)
        with pytest.raises(ServerClosed, match="unknown kind 0x42"):
            client.push({"x": np.ones(4, np.float32)})  # it commits nothing more
        again = server.client(0)  # a new incarnation is welcome
        again.pull(timeout=10)
        again.push({"x": np.ones(4, np.float32)})
        assert again.wait(timeout=10).status == "applied"
        client.close()
        again.close()
    err = capfd.readouterr().err
    assert (
        "shard 0: worker 0 (incarnation 1) sent a message of unknown kind 0x42 (1 bytes); "
        "disconnecting it" in err
    )
