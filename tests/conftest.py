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


# -- the one Ray cluster the Ray test files share (tests/ray_helpers.py) --------------------
# Started by the first test that asks for it (ray_cluster or ray_address), shut down after
# the last test of the session that names one of them, and at the session's end whatever
# happens; a test that asks after that starts it again.

_RAY_FIXTURES = {"ray_cluster", "ray_address"}
_last_ray_test: str | None = None  # the node id of the last selected test that names one


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "shared_ray: asks for the shared cluster only inside (request.getfixturevalue)"
    )


def _uses_shared_ray(item) -> bool:
    named = _RAY_FIXTURES & set(item.fixturenames)
    return bool(named) or item.get_closest_marker("shared_ray") is not None


@pytest.fixture
def ray_address():
    """The shared cluster's address (for a child's ``RAY_ADDRESS``), every CPU free."""
    import ray_helpers

    nodes = ray_helpers.shared()
    ray_helpers.wait_idle(nodes)
    return nodes.address


@pytest.fixture(scope="module")
def _ray_module():
    """This process leaves Ray after its module's tests (the shared cluster stays up)."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture
def ray_cluster(_ray_module):
    """The shared cluster, this process a driver of it and every CPU free; the ``Cluster``
    (``.address``)."""
    ray = pytest.importorskip("ray")
    import ray_helpers

    nodes = ray_helpers.shared()
    if ray.is_initialized() and ray.get_runtime_context().gcs_address != nodes.address:
        ray.shutdown()  # a driver of another cluster
    if not ray.is_initialized():
        ray.init(address=nodes.address, include_dashboard=False, logging_level="warning")
    ray_helpers.wait_idle(nodes)
    return nodes


@pytest.fixture
def no_ray_driver():
    """This process connected to no Ray cluster, before and after the test (the shared
    cluster, if it runs, stays up)."""
    import ray

    ray.shutdown()
    yield
    ray.shutdown()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that name the shared cluster run one after the other, where the last of
    them was (the others keep their order): the cluster is up only while they run, not
    idling beside the files between them (test_gpt_example's Ray case came some ten
    files before test_ray)."""
    global _last_ray_test
    uses = [_uses_shared_ray(item) for item in items]
    if not any(uses):
        _last_ray_test = None
        return
    last = max(i for i, used in enumerate(uses) if used)
    before = [item for item, used in zip(items[:last], uses, strict=False) if not used]
    users = [item for item, used in zip(items, uses, strict=True) if used]
    items[:] = before + users + items[last + 1 :]
    _last_ray_test = users[-1].nodeid


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        if item.nodeid == _last_ray_test:  # no later test names the shared cluster
            _stop_shared_ray()


def pytest_sessionfinish(session, exitstatus):
    _stop_shared_ray()


def _stop_shared_ray():
    import ray_helpers

    ray_helpers.stop_shared()
