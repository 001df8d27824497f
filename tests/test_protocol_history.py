"""The sender's residual history, without Ray: which residual matches the shards' pushes.

A worker keeps each push's error-feedback residual in a
:class:`~stalewise.protocol.sender.History` before any shard gets the push (Ray:
in the worker id's keeper actor). A checkpoint's cut and a dead incarnation's
successor then read the residual after exactly the pushes the shards applied.
"""

import doctest

import numpy as np

from stalewise import codecs, staleness
from stalewise.protocol import pipeline, sender
from stalewise.protocol.compress import Compressor
from stalewise.protocol.sender import History, Sender
from stalewise.segments import Segments


def test_the_protocol_docstrings_examples_hold():
    assert doctest.testmod(sender).failed == 0
    assert doctest.testmod(pipeline).failed == 0


def topk_sender():
    seg = Segments.from_sizes(["w"], [1000])  # small leaves are sent whole
    comp = Compressor(codecs.topk(0.05), seg, [(0, 1000)])
    return Sender(seg, staleness.constant(), shards=1, compressor=comp), comp


def test_a_successor_resumes_from_the_residual_after_the_last_push_the_shards_have():
    s, comp = topk_sender()
    history = History()
    history.keep(1, 0, s.residual, acked=0)  # the residual incarnation 1 starts from
    rng = np.random.default_rng(0)
    after = []
    payload = [bytearray(comp.nbytes(0))]
    for seq in range(4):
        update = rng.standard_normal(1000).astype(np.float32)
        s.encode(update, payload)
        s.judge(update)
        s.committed()
        history.keep(1, seq + 1, s.residual, acked=max(seq - 1, 0))  # 2 in flight
        after.append(s.residual.copy())
    # the shards handled 3 of its 4 pushes when it died: the residual after push 2
    np.testing.assert_array_equal(history.at(1, 3), after[2])
    np.testing.assert_array_equal(history.at(1, 4), after[3])
    assert history.at(1, 1) is None  # every shard acknowledged push 1 and later: gone
    assert history.at(1, None) is None  # the shards' count is unknown: no residual


def test_what_is_kept_is_a_copy_and_a_new_incarnation_replaces_the_old():
    history = History()
    r = np.ones(3, np.float32)
    history.keep(1, 2, r, acked=0)
    r[:] = 7  # the sender writes its next residual into the same buffer
    assert history.at(1, 2).tolist() == [1.0, 1.0, 1.0]
    history.keep(2, 0, history.latest(), acked=0)  # the successor starts from it
    assert history.at(1, 2) is None and history.at(2, 0).tolist() == [1.0, 1.0, 1.0]
    history.keep(2, 1, np.zeros(3, np.float32), acked=1)
    assert history.at(2, 0) is None and history.latest().tolist() == [0.0, 0.0, 0.0]
    history.clear()  # e.g. the shards were rolled back: nothing is known until it pushes
    assert history.latest() is None and history.at(2, 1) is None
