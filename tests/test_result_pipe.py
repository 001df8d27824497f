"""The local runtime's result pipe (worker -> parent): fixed binary records, nothing unpickled.

A worker's heartbeats and how its loop ended reach the parent as the records of
:mod:`stalewise.runtime.local.wire` (``decode_result``). Bytes that are no such
record are that worker's failure, under the job's failure policy; a pickle is
never loaded. The runs below have a worker whose ``loss_and_grad`` writes into
its own result pipe (found on the stack, as a bug in user code could): junk, a
frame of an unknown kind, and a pickle whose loading would create a file.
"""

import math
import os
import pickle
import sys

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.local import wire

# -- the records ---------------------------------------------------------------------------


def test_every_result_record_round_trips_and_names_its_worker():
    assert wire.decode_result(wire.worker_ready(3), 3) == ("ready", 3)
    assert wire.decode_result(wire.beat(3, 12.25), 3) == ("beat", 3, 12.25)
    assert wire.decode_result(wire.done(3), 3) == ("done", 3)
    assert wire.decode_result(wire.diverged(3, "refused ✗"), 3) == ("diverged", 3, "refused ✗")
    tb = "Traceback (most recent call last):\n  ...\nValueError: bad ✗\n"
    assert wire.decode_result(wire.failed(3, tb, "ValueError: bad ✗"), 3) == (
        "error",
        3,
        tb,
        "ValueError: bad ✗",
    )
    with pytest.raises(wire.WireError, match=r"^a message naming worker 3 on worker 0's pipe$"):
        wire.decode_result(wire.done(3), 0)


def test_a_long_traceback_keeps_its_end_and_fits_a_result_frame():
    tb = "".join(f"  File 'x.py', line {i}\n" for i in range(10_000)) + "ValueError: last\n"
    body = wire.failed(0, tb, "ValueError: last" * 2000)
    assert len(body) <= wire.MAX_RESULT
    _, _, kept, summary = wire.decode_result(body, 0)
    assert kept.startswith("...\n") and kept.endswith("ValueError: last\n")
    assert len(kept.encode()) <= wire.MAX_TRACEBACK
    assert summary.startswith("ValueError: last") and len(summary) <= wire.MAX_TEXT


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "an empty message"),
        (pickle.dumps(("done", 0)), "unknown kind 0x80"),
        (b"\x99" + bytes(8), "unknown kind 0x99"),
        (wire.done(0) + b"x", "wrong size"),
        (wire.beat(0, 1.0)[:-1], "wrong size"),
        (wire.beat(0, math.nan), "not finite"),
        (wire.beat(0, math.inf), "not finite"),
        (wire.failed(0, "tb", "s")[:9] + (2**31).to_bytes(4, "little") + b"tb", "wrong size"),
        (b"\x44" + bytes(8) + b"x" * wire.MAX_RESULT, "wrong size"),
    ],
    ids=["empty", "pickle", "unknown", "long", "short", "nan", "inf", "tail", "oversize"],
)
def test_bytes_that_are_no_result_record_are_refused(body, message):
    with pytest.raises(wire.WireError, match=message):
        wire.decode_result(body, 0)


# -- a worker that writes into its result pipe ---------------------------------------------


class Marker:
    """Unpickling it runs code: it creates the file ``path``."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def result_pipe():
    """The worker process's result pipe, from the frame of the worker's main function."""
    frame = sys._getframe()
    while frame is not None and frame.f_code.co_name != "_worker_main":
        frame = frame.f_back
    assert frame is not None, "not called in a worker process"
    return frame.f_locals["results"]


class WritesIntoItsResultPipe:
    """A quadratic ``loss_and_grad`` (target 0) that, at batch 5 of the first worker to get
    there (once per run: ``flag`` is created exclusively and names it), writes ``what``
    into its own result pipe, then goes on."""

    def __init__(self, tmp_path, what):
        self.flag, self.marker, self.what = str(tmp_path / "wrote"), str(tmp_path / "ran"), what

    def __call__(self, params, batch):
        if batch == 5:
            try:
                fd = os.open(self.flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                fd = None
            if fd is not None:
                conn = result_pipe()
                os.write(fd, str(conn_worker()).encode())
                os.close(fd)
                if self.what == "junk":  # its first four bytes read as a bad length
                    os.write(conn.fileno(), b"\xde\xad\xbe\xef and then some junk")
                elif self.what == "unknown kind":
                    conn.send_bytes(b"\x99 a frame of no kind a worker sends")
                else:  # a pickle, as Connection.send writes one
                    conn.send(Marker(self.marker))
        return mp_helpers.quadratic_loss_and_grad(params, np.zeros(8, np.float32))


def conn_worker():
    """The worker id of this worker process (its main function's ``client``)."""
    frame = sys._getframe()
    while frame.f_code.co_name != "_worker_main":
        frame = frame.f_back
    return frame.f_locals["client"].worker


@pytest.mark.parametrize("what", ["junk", "unknown kind", "pickle"])
def test_a_malformed_result_message_is_that_workers_failure_and_nothing_is_unpickled(
    no_leaks, tmp_path, what
):
    loss = WritesIntoItsResultPipe(tmp_path, what)
    job = sw.Job({"x": np.full(8, 5.0, np.float32)}, optimizer=sw.optim.sgd(0.1))
    result = job.train(
        loss,
        data=mp_helpers.counting_data,
        workers=2,
        steps=300,
        metrics=sw.Metrics(every=0.05),
        timeouts=sw.Timeouts(total=120),
    )
    assert os.path.exists(loss.flag), "no worker wrote into its result pipe"
    with open(loss.flag) as f:
        w = int(f.read())
    assert not os.path.exists(loss.marker), "the parent unpickled what the worker sent"
    assert [(e.get("worker"), e["action"]) for e in result.failures] == [(w, "restarted")]
    cause = result.failures[0]["cause"]
    assert cause.startswith("sent a malformed message on its result pipe ("), cause
    assert result.pushes >= 300 and result.stop_reason.startswith("the budget"), result.stop_reason
    np.testing.assert_allclose(result.params["x"], 0.0, atol=0.05)
