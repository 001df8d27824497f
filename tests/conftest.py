import os

import pytest

from stalewise.runtime.local.shm import leaked_blocks


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves a shared-memory block or a child process behind."""
    import multiprocessing as mp

    mine = f"stalewise-{os.getpid()}-"  # blocks are named after the process that made them
    yield
    leaked = [b for b in leaked_blocks() if b.startswith(mine)]
    assert not leaked, f"leaked shared-memory blocks: {leaked}"
    alive = [p for p in mp.active_children() if p.is_alive()]
    assert not alive, f"child processes left running: {alive}"
