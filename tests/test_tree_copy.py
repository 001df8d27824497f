"""The measured copy behind ``tree.flatten_measured``: ``tree._copy_sumsq`` copies a vector
with non-temporal stores and returns its sum of squares in float64, whatever the lengths and
alignments."""

import subprocess
import sys

import numpy as np
import pytest

from stalewise import tree


def ref(x: np.ndarray) -> float:
    x = x.astype(np.float64)
    return float(x @ x)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_copies_and_measures_any_length_at_any_offsets(dtype):
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 1000):
        for d_off in range(9):  # the destination's head: 0 to 8 elements before 32 bytes
            for s_off in (0, 1, 3):  # a source off the destination's alignment
                src = rng.standard_normal(n + s_off).astype(dtype)[s_off:]
                buf = np.full(n + 20, 7.0, dtype)
                dst = buf[d_off : d_off + n]
                got = tree._copy_sumsq(dst, src)
                assert dst.tobytes() == src.tobytes(), (n, d_off, s_off)
                assert (buf[:d_off] == 7).all() and (buf[d_off + n :] == 7).all()
                assert got == pytest.approx(ref(src), rel=1e-12, abs=0), (n, d_off, s_off)


def test_non_finite_values_and_squares_past_float32():
    for at in (0, 5, 40, 99):  # in the head, the vectors, the tail
        for bad, check in ((np.nan, np.isnan), (np.inf, np.isposinf), (-np.inf, np.isposinf)):
            src = np.ones(100, np.float32)
            src[at] = bad
            dst = np.zeros(104, np.float32)[1:101]
            assert check(tree._copy_sumsq(dst, src)), (at, bad)
            assert dst.tobytes() == src.tobytes()
    src = np.full(100, 1e30, np.float32)  # each square overflows float32, not float64
    src[7] = -3e38
    got = tree._copy_sumsq(np.empty(100, np.float32), src)
    assert np.isfinite(got) and got == pytest.approx(ref(src), rel=1e-12)


def test_a_read_only_source_is_copied_and_mismatches_are_refused():
    src = np.arange(50, dtype=np.float32)
    src.flags.writeable = False
    dst = np.zeros(50, np.float32)
    assert tree._copy_sumsq(dst, src) == ref(src)
    assert (dst == src).all()
    before = dst.copy()
    with pytest.raises(ValueError, match="cannot copy float64 \\(50,\\) into float32 \\(50,\\)"):
        tree._copy_sumsq(dst, src.astype(np.float64))
    with pytest.raises(ValueError, match="cannot copy float16"):
        tree._copy_sumsq(dst.astype(np.float16), src.astype(np.float16))
    with pytest.raises(ValueError, match=r"cannot copy float32 \(25,\) into float32 \(25,\)"):
        tree._copy_sumsq(dst[::2], src[:25])
    assert dst.tobytes() == before.tobytes()


@pytest.mark.parametrize("stream", [False, True])
def test_flatten_copies_every_element_when_ranges_overlap_or_leave_gaps(monkeypatch, stream):
    monkeypatch.setattr(tree, "STREAM", 0 if stream else 1 << 40)
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(n).astype(np.float32) for k, n in (("a", 37), ("b", 50))}
    spec = tree.flatten(params)[1]
    ranges = [(3, 40), (20, 60), (60, 60)]  # overlapping, an empty one, 0-3 and 60-87 in none
    out = np.zeros(spec.size, np.float32)
    flat, _, sums = tree.flatten_measured(params, ranges, spec=spec, out=out)
    want = np.concatenate([params["a"], params["b"]])
    assert flat.tobytes() == want.tobytes()
    rel = 1e-12 if stream else 1e-6  # float64 sums, or float32 dot products
    assert sums == pytest.approx([ref(want[lo:hi]) for lo, hi in ranges], rel=rel)
    params["b"][0] = 3e38  # finite; the range's sum passes float32's largest value: Inf
    sums = tree.flatten_measured(params, ranges, spec=spec, out=out)[2]
    assert [np.isinf(s) for s in sums] == [True, True, False]


def test_the_streaming_copy_loads_no_numba():
    code = (
        "import sys, numpy as np, stalewise.tree as t; t.STREAM = 0; "
        "print(t.flatten_measured({'a': np.ones(40, np.float32)}, [(0, 40)])[2], 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[40.0] False"


def test_a_worker_client_compiles_the_streaming_copy_as_it_attaches(monkeypatch):
    import stalewise as sw

    monkeypatch.setattr(tree, "STREAM", 0)
    tree._streamer.cache_clear()
    job = sw.Job({"w": np.zeros(64, np.float32)}, optimizer=sw.optim.sgd(0.1))
    with job.serve(workers=1) as server:
        server.client(0).peek()  # attached, nothing pushed
        assert tree._streamer.cache_info().currsize == 1
