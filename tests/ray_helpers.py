"""Ray clusters of two nodes on this machine for the tests (``ray.cluster_utils``).

:func:`two_nodes` starts a cluster of a test's own (for tests that add or remove nodes,
or that must not share one); :func:`shared` is the one cluster the Ray test files share
(``ray_cluster`` and ``ray_address`` in conftest.py), started by the first test that asks
for it and stopped by :func:`stop_shared` after the last one.
"""

import contextlib
import time
from collections.abc import Iterator

SHARED_CPUS = (2, 2)  # the shared cluster's head and second node: a rank of `stalewise run` a CPU
SHARED_STORE_MB = 150  # the head's object store


@contextlib.contextmanager
def two_nodes(head_cpus: int = 2, node_cpus: int = 2, head_store_mb: int = 100) -> Iterator:
    """A head node and a second node (``*_cpus`` CPUs each, a small object store), shut
    down whatever happens; yields the ``Cluster`` (its ``address`` for drivers)."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": head_cpus,
            "object_store_memory": head_store_mb * 2**20,
            "include_dashboard": False,
        },
    )
    try:
        nodes.add_node(num_cpus=node_cpus, object_store_memory=100 * 2**20)
        nodes.wait_for_nodes(timeout=60)
        yield nodes
    finally:
        nodes.shutdown()


_shared: tuple[contextlib.ExitStack, object] | None = None  # (its clean-up, the Cluster)


def shared():
    """The shared cluster (:data:`SHARED_CPUS`), started at the first call. A start that
    fails shuts down what it started and raises."""
    global _shared
    if _shared is None:
        stack = contextlib.ExitStack()
        nodes = stack.enter_context(two_nodes(*SHARED_CPUS, SHARED_STORE_MB))
        _shared = stack, nodes
    return _shared[1]


def stop_shared() -> None:
    """Disconnects this process from Ray and shuts the shared cluster down, if it runs."""
    global _shared
    if _shared is None:
        return
    import ray

    (stack, _), _shared = _shared, None
    try:
        ray.shutdown()
    finally:
        stack.close()


def wait_idle(nodes, timeout: float = 60) -> None:
    """Waits until every CPU of ``nodes`` (a ``Cluster``) is free: the actors of a test
    before are killed asynchronously. Fails saying how many are still held."""
    state = nodes.global_state  # the cluster's own view: no driver needed
    total = state.cluster_resources().get("CPU", 0)
    deadline = time.monotonic() + timeout
    while (free := state.available_resources().get("CPU", 0)) < total:
        assert time.monotonic() < deadline, (
            f"the shared Ray cluster has {free:g} of {total:g} CPUs free after {timeout} s: "
            "a test before left actors or placement groups behind"
        )
        time.sleep(0.1)
