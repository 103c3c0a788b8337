"""Where this process sits in a job, read from the variables its launcher exported.

Launchers are tried innermost first, and the first one whose variables are
present wins:

1. torchrun (``RANK`` and ``WORLD_SIZE``),
2. Open MPI's mpirun (``OMPI_COMM_WORLD_RANK``),
3. MPICH / Intel MPI Hydra (``PMI_RANK``),
4. Slurm's srun (``SLURM_PROCID``, inside a job step),
5. otherwise a single process.

Innermost first because launchers nest: torchrun or mpirun started inside a
Slurm allocation still sees the ``SLURM_*`` variables, and those describe the
allocation (or the one srun task that started the inner launcher), not the
ranks. For the same reason ``PMI_RANK`` counts as Hydra only when Hydra's own
``MPI_LOCALRANKID`` is set or there is no ``SLURM_PROCID``: ``srun --mpi=pmi2``
exports ``PMI_RANK``/``PMI_SIZE`` itself, and then the Slurm variables describe
the very same ranks, with node placement included.

A batch script is not a step: sbatch gives it ``SLURM_PROCID=0`` and the
allocation's ``SLURM_NTASKS``, but no step id, and what it runs directly (no
srun) is one process, not rank 0 of the allocation's tasks waiting for peers.

Launchers that omit local or node variables are assumed to place ranks in
blocks: the local size defaults to the world size (one node), the local rank to
``rank % local_size``, the node rank to ``rank // local_size`` and the node
count to ``ceil(world_size / local_size)``. Open MPI and Hydra never say which
node a rank is on, so their node fields always come from this assumption;
:func:`with_hostnames` replaces it with the exact placement once the ranks have
exchanged hostnames (an MPI allgather). Slurm ranks must carry
``SLURM_LOCALID`` and ``SLURM_NODEID``, which srun always exports, because a
guess there would silently put two ranks on one GPU.

Everything here is a pure function of an environment mapping, so tests and
launch planners can describe any rank of any job without touching
``os.environ``.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from hpc.errors import LaunchEnvError
from hpc.runtime.hostlist import expand_hostlist, expand_tasks_per_node


class Launcher(enum.StrEnum):
    TORCHRUN = "torchrun"
    OPENMPI = "openmpi"
    MPICH = "mpich"
    SLURM = "slurm"
    SINGLE = "single"


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job; ``hosts`` is ``()`` when the launcher does not say."""

    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    hosts: tuple[str, ...]
    launcher: Launcher
    job_id: str | None

    @property
    def is_mpi(self) -> bool:
        return self.launcher in (Launcher.OPENMPI, Launcher.MPICH)

    @property
    def master_host(self) -> str | None:
        """The first node, where rank 0 runs under block placement, or None if unknown."""
        return self.hosts[0] if self.hosts else None

    @property
    def is_single(self) -> bool:
        return self.world_size == 1


def detect_rank_info(environ: Mapping[str, str]) -> RankInfo:
    """Read this process's place in the job, trying launchers innermost first (see module docs)."""
    job_id = _job_id(environ)
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_rank_variables(environ, _TORCHRUN_VARIABLES, job_id)
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _from_rank_variables(environ, _OPENMPI_VARIABLES, job_id)
    if "PMI_RANK" in environ and ("MPI_LOCALRANKID" in environ or "SLURM_PROCID" not in environ):
        return _from_rank_variables(environ, _MPICH_VARIABLES, job_id)
    if "SLURM_PROCID" in environ and not _is_batch_script(environ):
        return _from_slurm(environ, job_id)
    return RankInfo(0, 1, 0, 1, 0, 1, (), Launcher.SINGLE, job_id)


def with_hostnames(info: RankInfo, hostnames_by_rank: Sequence[str]) -> RankInfo:
    """Replace the assumed placement with the real one, given every rank's hostname.

    MPI launchers do not export node variables, so after an allgather of
    hostnames this makes node and local fields exact even for round-robin
    placement. Nodes are numbered in order of their first rank.
    """
    if len(hostnames_by_rank) != info.world_size:
        raise ValueError(
            f"got {len(hostnames_by_rank)} hostnames for a world of {info.world_size} ranks"
        )
    hosts = tuple(dict.fromkeys(hostnames_by_rank))
    my_host = hostnames_by_rank[info.rank]
    return dataclasses.replace(
        info,
        hosts=hosts,
        node_rank=hosts.index(my_host),
        num_nodes=len(hosts),
        local_rank=hostnames_by_rank[: info.rank].count(my_host),
        local_size=hostnames_by_rank.count(my_host),
    )


@dataclass(frozen=True)
class _Setting:
    """An integer with a description of its source, so range errors can name the variable."""

    value: int
    origin: str


@dataclass(frozen=True)
class _RankVariables:
    """The names one launcher uses; ``None`` where it has no such variable."""

    launcher: Launcher
    rank: str
    world_size: str
    local_rank: str
    local_size: str
    node_rank: str | None = None
    num_nodes: str | None = None


_TORCHRUN_VARIABLES = _RankVariables(
    Launcher.TORCHRUN,
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
)
_OPENMPI_VARIABLES = _RankVariables(
    Launcher.OPENMPI,
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)
_MPICH_VARIABLES = _RankVariables(
    Launcher.MPICH, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"
)

_SLURM_WORLD_SIZE = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
_SLURM_NODE_LIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_SLURM_NUM_NODES = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
_SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def _from_rank_variables(
    environ: Mapping[str, str], names: _RankVariables, job_id: str | None
) -> RankInfo:
    launcher = names.launcher
    rank = _parse(names.rank, environ[names.rank], launcher, positive=False)
    world = _required(environ, names.world_size, names.rank, launcher, positive=True)
    local_size = _read(environ, names.local_size, launcher, positive=True) or _Setting(
        world.value,
        f"local size {world.value} ({names.world_size}, as {names.local_size} is unset)",
    )
    local_rank = _read(environ, names.local_rank, launcher, positive=False) or _derived(
        "local rank", rank.value % local_size.value, f"{names.rank} % local size"
    )
    node_rank = _read(environ, names.node_rank, launcher, positive=False) or _derived(
        "node rank", rank.value // local_size.value, f"{names.rank} // local size"
    )
    num_nodes = _read(environ, names.num_nodes, launcher, positive=True) or _derived(
        "node count",
        math.ceil(world.value / local_size.value),
        f"{names.world_size} / local size, rounded up",
    )
    _check_nodes(launcher, rank, world, node_rank, num_nodes)
    _check_local(launcher, world, local_rank, local_size)
    return _rank_info(launcher, job_id, (), rank, world, local_rank, local_size, node_rank, num_nodes)


def _from_slurm(environ: Mapping[str, str], job_id: str | None) -> RankInfo:
    launcher = Launcher.SLURM
    rank = _parse("SLURM_PROCID", environ["SLURM_PROCID"], launcher, positive=False)
    world = _first_required(environ, _SLURM_WORLD_SIZE, launcher)
    local_rank = _required(environ, "SLURM_LOCALID", "SLURM_PROCID", launcher, positive=False)
    node_rank = _required(environ, "SLURM_NODEID", "SLURM_PROCID", launcher, positive=False)
    node_list_name = _first_present(environ, _SLURM_NODE_LIST)
    hosts = _slurm_hosts(environ, node_list_name, launcher)
    num_nodes = _first(environ, _SLURM_NUM_NODES, launcher)
    if num_nodes is None:
        num_nodes = (
            _derived("node count", len(hosts), f"length of {node_list_name}")
            if hosts
            else _derived("node count", 1, "no node count or node list set")
        )
    if node_list_name is not None and len(hosts) != num_nodes.value:
        raise LaunchEnvError(
            f"{node_list_name}={environ[node_list_name]!r} names {len(hosts)} nodes"
            f" but {num_nodes.origin}",
            launcher=launcher.value,
        )
    _check_nodes(launcher, rank, world, node_rank, num_nodes)
    local_size = _slurm_local_size(environ, node_rank, num_nodes, world, launcher)
    _check_local(launcher, world, local_rank, local_size)
    return _rank_info(launcher, job_id, hosts, rank, world, local_rank, local_size, node_rank, num_nodes)


def _rank_info(launcher: Launcher, job_id: str | None, hosts: tuple[str, ...], *settings: _Setting) -> RankInfo:
    """A RankInfo from the checked settings, in RankInfo's field order (rank, world size, local rank and size,
    node rank and count)."""
    return RankInfo(*(setting.value for setting in settings), hosts=hosts, launcher=launcher, job_id=job_id)


def _slurm_hosts(
    environ: Mapping[str, str], name: str | None, launcher: Launcher
) -> tuple[str, ...]:
    if name is None:
        return ()
    try:
        return expand_hostlist(environ[name])
    except ValueError as error:
        raise LaunchEnvError(
            f"{name}={environ[name]!r} is not a valid hostlist: {error}", launcher=launcher.value
        ) from error


def _slurm_local_size(
    environ: Mapping[str, str],
    node_rank: _Setting,
    num_nodes: _Setting,
    world: _Setting,
    launcher: Launcher,
) -> _Setting:
    """Tasks on this node: heterogeneous steps only say so through the tasks-per-node list."""
    name = _first_present(environ, _SLURM_TASKS_PER_NODE)
    if name is not None:
        raw = environ[name]
        try:
            counts = expand_tasks_per_node(raw)
        except ValueError as error:
            raise LaunchEnvError(
                f"{name}={raw!r} is not a valid tasks-per-node list: {error}",
                launcher=launcher.value,
            ) from error
        if len(counts) == 1:
            return _Setting(counts[0], f"{name}={raw!r}")
        if len(counts) != num_nodes.value:
            raise LaunchEnvError(
                f"{name}={raw!r} lists {len(counts)} nodes but {num_nodes.origin}",
                launcher=launcher.value,
            )
        count = counts[node_rank.value]
        return _Setting(count, f"local size {count} ({name}={raw!r} at node {node_rank.value})")
    return _read(environ, "SLURM_NTASKS_PER_NODE", launcher, positive=True) or _derived(
        "local size", world.value // num_nodes.value, f"{world.origin} // {num_nodes.origin}"
    )


def _check_nodes(
    launcher: Launcher, rank: _Setting, world: _Setting, node_rank: _Setting, num_nodes: _Setting
) -> None:
    """Reject placements no launcher produces; checked before the node's local size is looked up."""
    _check_below(rank, world, launcher)
    _check_at_most(num_nodes, world, launcher)
    _check_below(node_rank, num_nodes, launcher)


def _check_local(
    launcher: Launcher, world: _Setting, local_rank: _Setting, local_size: _Setting
) -> None:
    _check_at_most(local_size, world, launcher)
    _check_below(local_rank, local_size, launcher)


def _check_below(value: _Setting, limit: _Setting, launcher: Launcher) -> None:
    if value.value >= limit.value:
        raise LaunchEnvError(f"{value.origin} is not below {limit.origin}", launcher=launcher.value)


def _check_at_most(value: _Setting, limit: _Setting, launcher: Launcher) -> None:
    if value.value > limit.value:
        raise LaunchEnvError(f"{value.origin} exceeds {limit.origin}", launcher=launcher.value)


def _derived(what: str, value: int, how: str) -> _Setting:
    return _Setting(value, f"{what} {value} ({how})")


def _read(
    environ: Mapping[str, str], name: str | None, launcher: Launcher, *, positive: bool
) -> _Setting | None:
    if name is None or name not in environ:
        return None
    return _parse(name, environ[name], launcher, positive=positive)


def _parse(name: str, raw: str, launcher: Launcher, *, positive: bool) -> _Setting:
    """Parse a count strictly: int() would accept ' 3', '+3' and '3_0', which no launcher writes."""
    wanted = "a positive integer" if positive else "a non-negative integer"
    if not (raw.isascii() and raw.isdigit()) or (positive and int(raw) == 0):
        raise LaunchEnvError(f"{name}={raw!r} is not {wanted}", launcher=launcher.value)
    value = int(raw)
    return _Setting(value, f"{name}={value}")


def _required(
    environ: Mapping[str, str], name: str, because: str, launcher: Launcher, *, positive: bool
) -> _Setting:
    setting = _read(environ, name, launcher, positive=positive)
    if setting is None:
        raise LaunchEnvError(f"{name} is not set although {because} is", launcher=launcher.value)
    return setting


def _first(environ: Mapping[str, str], names: Sequence[str], launcher: Launcher) -> _Setting | None:
    name = _first_present(environ, names)
    return None if name is None else _read(environ, name, launcher, positive=True)


def _first_required(
    environ: Mapping[str, str], names: Sequence[str], launcher: Launcher
) -> _Setting:
    setting = _first(environ, names, launcher)
    if setting is None:
        raise LaunchEnvError(
            f"none of {', '.join(names)} is set although SLURM_PROCID is", launcher=launcher.value
        )
    return setting


def _first_present(environ: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((name for name in names if name in environ), None)


def _is_batch_script(environ: Mapping[str, str]) -> bool:
    """A job without a step: srun always exports the step id (``SLURM_STEP_ID``, and its old name ``SLURM_STEPID``)."""
    return "SLURM_JOB_ID" in environ and "SLURM_STEP_ID" not in environ and "SLURM_STEPID" not in environ


def _job_id(environ: Mapping[str, str]) -> str | None:
    """One id for logs and checkpoints; array tasks get Slurm's ``JOB_TASK`` form so they differ."""
    if environ.get("HPC_JOB_ID"):
        return environ["HPC_JOB_ID"]
    array_job, array_task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array_job and array_task:
        return f"{array_job}_{array_task}"
    if environ.get("SLURM_JOB_ID"):
        return environ["SLURM_JOB_ID"]
    run_id = environ.get("TORCHELASTIC_RUN_ID")
    return run_id if run_id and run_id != "none" else None
