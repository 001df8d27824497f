"""benchmarks/lm.py's streaming rows: the fragments torchft's Streaming DiLoCo is given, and
the tokens of an overlapped streaming run (the steps taken while a push is in flight count
with the next push)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
from stalewise import tasks

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = dict(size="tiny", context=16, batch_size=4, corpus_bytes=200_000, eval_windows=8)


@pytest.fixture(scope="module")
def lm():
    sys.path.insert(0, str(BENCH))  # lm imports _report; worker processes import lm
    try:
        import lm

        yield lm
    finally:
        sys.path.remove(str(BENCH))


def test_the_peer_gets_our_fragments_in_the_order_we_push_them(lm):
    task = tasks.get("lm", **TINY)
    frags = lm.stream_fragments(task)
    s = sw.strategies.streaming_diloco(local_steps=20, fragments=lm.FRAGMENTS, delay=lm.TAU)
    state = s.init(task.init_params(0))
    seg = state.spec.segments
    ours = [{n for n, o in zip(seg.names, seg.offsets, strict=True)
             if any(a <= o < b for a, b in runs)} for runs in state.runs]  # fmt: skip
    assert sorted(n for f in frags for n in f) == sorted(seg.names)  # each leaf once
    # our first push (after 5 inner steps) is fragment 1, then 2, 3 and 0: torchft syncs
    # its fragments in list order
    assert [set(f) for f in frags] == [ours[k] for k in (1, 2, 3, 0)]
    assert all(ours)


def test_an_overlapped_streaming_run_counts_every_pushed_step(lm):
    """4 worker processes, streaming DiLoCo H=20 in 4 fragments with tau=2 under BSP: a
    push goes out every 5 inner steps, 2 of them taken while the last push was in flight;
    the last record stands at 5 steps a push, so those 2 count with the next push."""
    task = tasks.get("lm", **TINY)
    m = dict(steps=20, delay=0.0, eval_interval=0.1, compute=0.001)
    make = lambda lr: dict(  # noqa: E731
        strategy=sw.strategies.streaming_diloco(
            local_steps=20, fragments=4, delay=2, alpha=0.5, inner=sw.optim.adamw(lr)
        ),
        consistency=sw.BSP(),
    )
    r = lm.run_one(task, m, lm.STREAM, 3e-3, make, 5)
    per_push = 5 * task.tokens_per_batch
    assert r["records"][-1]["pushes"] == r["pushes"] > 0
    assert r["records"][-1]["tokens"] == r["pushes"] * per_push
    assert all(rec["tokens"] % per_push == 0 for rec in r["records"])


def test_torchfts_streaming_diloco_records_the_global_model_fragment_by_fragment(lm):
    """torchft's Streaming DiLoCo through the peer (2 replica groups, gloo, H=4 in 2
    fragments, tau=1): the first sync's global model has moved in fragment 0's leaves
    only, the second in both; a sync's tokens are H / P steps of every worker."""
    pytest.importorskip("torchft")
    import _torchft_peer

    task = tasks.get("lm", **TINY)
    names = sorted(n for n in lm.stream_fragments(task)[0])
    rest = [n for f in lm.stream_fragments(task)[1:] for n in f]
    syncs = 4
    captured = []
    r = _torchft_peer.run(task, 3e-3, 4, syncs, 2, 0.0, [1.0, 1.0], timeout=300,
                          outer=(0.7, 0.3), fragments=[names, rest], tau=1, alpha=0.5,
                          quantize=True, keep=captured)  # fmt: skip
    assert [rec["tokens"] for rec in r["records"]] == [
        k * 2 * 2 * task.tokens_per_batch for k in range(syncs + 1)
    ]
    assert r["quantized"] is False  # no Triton on CPU: float32 all-reduces
    init = _flat(task.init_params(0))
    first, second = captured[0], captured[1]
    moved = lambda state: {n for n in init if not np.array_equal(state[n], init[n])}  # noqa: E731
    assert moved(first) == set(names)
    assert moved(second) == set(names) | set(rest)


def _flat(tree: dict, pre: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{pre}{k}."))
        else:
            out[f"{pre}{k}"] = v.detach().numpy() if hasattr(v, "detach") else np.asarray(v)
    return out
