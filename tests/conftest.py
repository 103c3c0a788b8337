"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.nccl_rules import BACKEND

# What one machine holds once: the local Slurm clusters and the namespace testbed (their namespaces, ports and
# state). Under pytest-xdist the files that start them share one worker.
ONE_AT_A_TIME = {"test_netns.py", "test_plan.py"}  # the testbed, made by name

# a test over Gloo and again under NCCL's rules: it takes ``backend`` and hands it to ``run_ranks``. Here, not in
# tests/nccl_rules.py, which every rank process imports and which need not load pytest.
BOTH_BACKENDS = pytest.mark.parametrize("backend", ["gloo", BACKEND], ids=["gloo", "nccl-rules"])


# tryfirst: xdist's own hook turns the groups into node ids, so ours must have marked them already.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """Under pytest-xdist (``--dist loadgroup``) a file's tests share a worker, and the files that use a Slurm
    cluster or the testbed share one. Tests marked ``cuda`` skip where CUDA is absent: ``make test`` on a CPU
    machine and CI stay green."""
    if config.pluginmanager.hasplugin("xdist"):  # without it the marker is unknown (--strict-markers)
        for item in items:
            uses_cluster = any(name.startswith("slurm_cluster") for name in item.fixturenames)
            group = "clusters" if uses_cluster or item.path.name in ONE_AT_A_TIME else item.path.name
            item.add_marker(pytest.mark.xdist_group(group))
    needs_gpu = [item for item in items if item.get_closest_marker("cuda") is not None]
    if not needs_gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    for item in needs_gpu:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@dataclass(frozen=True)
class SlurmCluster:
    """A running local cluster: pass ``env`` to every Slurm command.

    On the 3-node cluster each node has a private /tmp: a job can write only under ``state``
    (and outside /tmp) for the test to read it back.
    """

    state: Path
    env: dict[str, str]
    nodes: tuple[str, ...]


def _local_cluster(nodes: int) -> Iterator[SlurmCluster]:
    from slurm.testbed import cluster

    reason = cluster.unavailable()
    if reason:
        pytest.skip(reason)
    # Not under pytest's tmp_path: munged and mariadbd run as their own users and must reach it.
    state = Path(tempfile.mkdtemp(prefix=f"hpc-slurm-{nodes}n-", dir="/tmp"))
    started: list[cluster.Daemon] = []
    try:
        cluster.start(state, nodes=nodes)
        record = cluster.read_record(state)
        started = cluster.daemons(record)
        yield SlurmCluster(state, {**os.environ, **cluster.client_env(state)}, tuple(record["node_names"]))
    finally:
        cluster.stop(state)
        shutil.rmtree(state, ignore_errors=True)
    survivors = [d.name for d in started if d.alive()]
    assert not survivors, f"still running after stop: {survivors}"


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """munged, MariaDB, slurmdbd, slurmctld and one slurmd (8 CPUs) on this machine, for the whole session."""
    yield from _local_cluster(1)


@pytest.fixture(scope="session")
def slurm_cluster_3nodes() -> Iterator[SlurmCluster]:
    """The same with three nodes (two for a job, one its spare), each a network namespace with its own hostname,
    /etc/hosts and /tmp."""
    yield from _local_cluster(3)
