"""Where the shared block's regions start within their pages (layout.Layout)."""

import itertools

import numpy as np
import pytest

from stalewise.runtime.local import layout as L
from stalewise.runtime.local.layout import Layout, Residuals
from stalewise.runtime.local.shm import SharedBlock


@pytest.mark.parametrize("size", [1, 3008, 1_000_003])
@pytest.mark.parametrize("payloads", [(), (1024, 808)])
def test_params_regions_share_a_large_arrays_page_offset_and_push_regions_are_half_a_page_off(
    size, payloads
):
    """A large numpy array's data sits 16 bytes into a page (glibc's mmap header): a copy
    between it and a region at another offset close above can run 3x slower (4K aliasing),
    so every region of params starts there, and the push regions half a page away."""
    big = np.empty(1 << 24, np.float32)  # 64 MB: above glibc's largest mmap threshold
    assert big.ctypes.data % L._PAGE == L._AT
    layout = Layout(size, "float32", 3, 2, payloads, feedback=bool(payloads))
    block = SharedBlock.create(layout.nbytes)
    try:
        base = block.array(np.uint8, 0, 1).ctypes.data
        assert base % L._PAGE == 0
        arrays = [layout.params(block), layout.observer(block)]
        arrays += [layout.snapshot(block, i) for i in (0, 1)]
        arrays += [layout.pull_buffer(block, w) for w in range(3)]
        if payloads:
            arrays += [b for pair in Residuals(layout, block).buffers for b in pair]
            pushes = [layout.payload(block, w, 0) for w in range(3)]
        else:
            pushes = [layout.push_buffer(block, w) for w in range(3)]
        assert {a.ctypes.data % L._PAGE for a in arrays} == {L._AT}
        assert {a.ctypes.data % L._PAGE for a in pushes} == {L._AT_PUSH}
        starts = sorted((a.ctypes.data, a.nbytes) for a in arrays + pushes)
        for (a, n), (b, _) in itertools.pairwise(starts):
            assert a + n <= b  # no two regions overlap
        assert starts[-1][0] + starts[-1][1] <= base + layout.nbytes
    finally:
        del arrays, pushes
        block.unlink()
        block.close()
