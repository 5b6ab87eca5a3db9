"""Fixtures shared by several test files."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from cluster import Cluster, ClusterUnavailable


@pytest.fixture
def two_hosts() -> Iterator[Cluster]:
    """Two network-namespace "hosts" (tests/cluster.py), torn down after the test; the
    test is skipped where there is no test bed (no root, no iproute2)."""
    try:
        with Cluster(2) as cluster:
            yield cluster
    except ClusterUnavailable as exc:
        pytest.skip(f"no multi-host test bed here: {exc}")
