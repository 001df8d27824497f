import pytest

from stalewise.runtime.shm import leaked_blocks


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves a shared-memory block or a child process behind."""
    import multiprocessing as mp

    before = set(leaked_blocks())
    yield
    assert set(leaked_blocks()) - before == set(), "leaked shared-memory blocks"
    alive = [p for p in mp.active_children() if p.is_alive()]
    assert not alive, f"child processes left running: {alive}"
