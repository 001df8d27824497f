"""A Ray cluster of two nodes on this machine for the tests (``ray.cluster_utils``)."""

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def two_nodes(head_cpus: int = 2, node_cpus: int = 2, head_store_mb: int = 100) -> Iterator:
    """A head node and a second node (``*_cpus`` CPUs each, a small object store), shut
    down whatever happens; yields the ``Cluster`` (its ``address`` for drivers)."""
    from ray.cluster_utils import Cluster

    nodes = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": head_cpus, "object_store_memory": head_store_mb * 2**20},
    )
    try:
        nodes.add_node(num_cpus=node_cpus, object_store_memory=100 * 2**20)
        nodes.wait_for_nodes(timeout=60)
        yield nodes
    finally:
        nodes.shutdown()
