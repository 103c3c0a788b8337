"""Join the job's torch.distributed process group from whatever launched this rank.

Rendezvous address, in order:
1. ``MASTER_ADDR``/``MASTER_PORT`` when both are set (torchrun, our local launcher, users);
2. under MPI, rank 0 picks its own address and a free port and broadcasts them with
   mpi4py (after an allgather of hostnames that fixes node placement exactly);
3. under Slurm, the first host of the node list and a port derived from the job id,
   so every task computes the same endpoint without talking to anyone;
4. a single process rendezvous with itself on loopback.

The store is created by hand rather than through ``init_method`` so that joining has
its own (short) timeout, separate from the collective timeout, and a rank that cannot
join fails within seconds with a message naming itself and the address.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import random
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc.errors import LaunchEnvError, RendezvousError
from hpc.runtime.env import Launcher, RankInfo, detect_rank_info, with_hostnames

if TYPE_CHECKING:
    import torch

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 12768  # up to 32767, below Linux's ephemeral ports (see free_port): none handed to a connection
CHOSEN_PORTS = range(10000, SLURM_PORT_BASE)  # where free_port looks first: below Slurm's and the kernel's ports
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
WORKERS_SETTLE_S = 0.05  # GIL released before the process group goes: see shutdown()


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    source: str  # "env", "mpi", "slurm" or "single": how the endpoint was chosen

    def __str__(self) -> str:
        return f"{self.addr}:{self.port}"


@dataclass(frozen=True)
class World:
    """This rank's view of the job once the default process group exists."""

    info: RankInfo
    backend: str
    device: torch.device
    rendezvous: Rendezvous

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def size(self) -> int:
        return self.info.world_size


def slurm_port(job_id: str | None) -> int:
    """A port every task of a Slurm job derives alike; distinct for concurrent jobs on a node."""
    digits = "".join(ch for ch in (job_id or "") if ch.isdigit())
    return SLURM_PORT_BASE + int(digits or 0) % SLURM_PORT_SPAN


def rendezvous_from_env(info: RankInfo, environ: Mapping[str, str]) -> Rendezvous | None:
    """The endpoint that needs no communication to agree on, or None (MPI must broadcast)."""
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    if addr and port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise LaunchEnvError(f"MASTER_PORT={port!r} is not a TCP port", rank=info.rank)
        return Rendezvous(addr, int(port), "env")
    if info.is_mpi:
        return None
    if info.launcher is Launcher.SLURM:
        if not info.hosts:
            raise LaunchEnvError("Slurm gave no node list (SLURM_JOB_NODELIST)", rank=info.rank)
        return Rendezvous(info.hosts[0], slurm_port(info.job_id), "slurm")
    if info.world_size == 1:
        return Rendezvous("127.0.0.1", free_port(), "single")
    raise LaunchEnvError(
        f"{info.launcher.value} started {info.world_size} ranks but MASTER_ADDR/MASTER_PORT are not set",
        rank=info.rank,
    )


def free_port(host: str = "") -> int:
    """A port free now for the rendezvous store, which binds it a moment later (after the ranks start).

    Not the kernel's pick (``bind(0)``): that comes from its ephemeral range, from which it also hands a port to
    every connection and ``bind(0)`` on the host meanwhile (Gloo makes dozens per group), and one that took this
    port would fail the store's bind: 5 windows in 3,000 of 40 such sockets did here. So one of
    ``CHOSEN_PORTS`` below that range, found free; the kernel's pick only where the range starts lower."""
    with contextlib.suppress(OSError, ValueError):
        with open(EPHEMERAL_RANGE) as handle:
            first_ephemeral = int(handle.read().split()[0])
        below = range(CHOSEN_PORTS.start, min(CHOSEN_PORTS.stop, first_ephemeral))
        for port in random.SystemRandom().sample(below, min(64, len(below))):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def routable_address(peer_hosts: tuple[str, ...]) -> str:
    """The local address other nodes reach us on: the source address of a route to a peer.

    Connecting a UDP socket sends nothing; it only asks the kernel which interface
    would be used. Falls back to the hostname's address when no peer is known.
    """
    for peer in peer_hosts:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.connect((peer, 9))
                return sock.getsockname()[0]
        except OSError:
            continue
    return socket.gethostbyname(socket.gethostname())


def _mpi_rendezvous(info: RankInfo) -> tuple[RankInfo, Rendezvous]:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != info.world_size:  # variables left from another launch, or a process mpirun did not start
        raise LaunchEnvError(f"the environment says {info.world_size} MPI ranks (Open MPI's or MPICH's variables) but "
                             f"MPI_COMM_WORLD has {comm.Get_size()}: start the ranks with mpirun, or unset those "
                             "variables", launcher=info.launcher.value)
    info = with_hostnames(info, comm.allgather(socket.gethostname()))
    endpoint = None
    if info.rank == 0:
        if info.num_nodes == 1:
            addr = "127.0.0.1"
        else:
            addr = routable_address(info.hosts[1:])
        endpoint = Rendezvous(addr, free_port(), "mpi")
    return info, comm.bcast(endpoint, root=0)


def select_device(requested: str = "auto") -> str:
    """The device type a rank computes on: ``auto`` is CUDA when a GPU is visible, else the CPU."""
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise LaunchEnvError("parallel.device='cuda' needs CUDA, and no GPU is visible")
    if requested not in ("cpu", "cuda"):
        raise LaunchEnvError(f"parallel.device={requested!r} is not one of auto, cpu, cuda")
    return requested


def select_backend(requested: str, device: str = "auto") -> str:
    """``auto`` is NCCL (with Gloo kept for CPU tensors) when ranks compute on GPUs, else Gloo. Gloo with
    CUDA tensors is allowed: it stages them through host memory, so several ranks can share one GPU."""
    import torch.distributed as dist

    device = select_device(device)
    if requested == "auto":
        requested = "nccl" if device == "cuda" and dist.is_nccl_available() else "gloo"
    if requested == "nccl":
        if device != "cuda":
            raise LaunchEnvError("parallel.backend='nccl' needs parallel.device='cuda' (or auto with a GPU visible)")
        return "cpu:gloo,cuda:nccl"
    return requested


# Where a rank's GPUs come from, named when ranks would share one: what CUDA reads, and what srun set and why.
GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURMD_TRES_BIND", "SLURM_GPUS_PER_TASK",
                 "SLURM_GPU_BIND")
GPU_VIEW_KEY = "hpc/gpus/{node}/{local}"  # in the rendezvous store: each rank's visible GPUs


def visible_gpus(environ: Mapping[str, str], device_count: int) -> tuple[str, ...]:
    """The GPUs this process sees, named so that ranks of one node can compare them: CUDA_VISIBLE_DEVICES'
    entries (what srun's ``--gpus-per-task``, ``--gpu-bind`` and ``--gpus-per-node`` set per task, or a
    wrapper script), in CUDA's order, the first ``device_count`` of them (CUDA stops at an invalid entry);
    with it unset, the node's GPUs ``0`` to ``device_count - 1``."""
    entries = [e.strip() for e in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    if "CUDA_VISIBLE_DEVICES" in environ and len(entries) >= device_count:
        return tuple(entries[:device_count])
    return tuple(str(index) for index in range(device_count))


def assign_gpus(views: Sequence[Sequence[str]]) -> list[int | None]:
    """One GPU per local rank where there is one: for each rank (``views[local_rank]`` its visible GPUs, as
    :func:`visible_gpus` names them), the CUDA ordinal it computes on, or None where every GPU it sees is
    another rank's. Ranks first take the first free GPU they see, in local-rank order (8 ranks that all see
    8 GPUs: rank r on ``cuda:r``; ranks that each see one GPU: ``cuda:0``); a rank left without one then
    takes one over from a rank that can move (an augmenting path), so a GPU is shared only where no
    assignment avoids it. Every rank of a node computes the same answer from the same views."""
    owner: dict[str, int] = {}
    for rank, view in enumerate(views):
        free = next((gpu for gpu in view if gpu not in owner), None)
        if free is not None:
            owner[free] = rank

    def take_over(rank: int, seen: set[str]) -> bool:
        for gpu in views[rank]:
            if gpu not in seen:
                seen.add(gpu)
                if gpu not in owner or take_over(owner[gpu], seen):
                    owner[gpu] = rank
                    return True
        return False

    for rank in range(len(views)):
        if rank not in owner.values():
            take_over(rank, set())
    held = {rank: gpu for gpu, rank in owner.items()}
    return [list(views[rank]).index(held[rank]) if rank in held else None for rank in range(len(views))]


def _sharers(views: Sequence[Sequence[str]], assigned: Sequence[int | None]) -> tuple[list[int], list[str]]:
    """The local ranks left without a GPU of their own, with every rank they compete with, and the GPUs
    all of these see (fewer GPUs than ranks: Hall's condition fails there)."""
    ranks = {rank for rank, index in enumerate(assigned) if index is None}
    while True:
        gpus = {gpu for rank in ranks for gpu in views[rank]}
        grown = ranks | {rank for rank, index in enumerate(assigned) if index is not None
                         and views[rank][index] in gpus}
        if grown == ranks:
            return sorted(ranks), sorted(gpus, key=lambda g: (len(g), g))
        ranks = grown


def _gpu_origin(environ: Mapping[str, str], device_count: int) -> str:
    named = [f"{name}={environ[name]}" for name in GPU_VARIABLES if name in environ]
    return ", ".join(named) if named else f"CUDA_VISIBLE_DEVICES unset: all {device_count} GPU(s) of the node"


def gpu_index(info: RankInfo, views: Sequence[Sequence[str]], backend: str,
              environ: Mapping[str, str] | None = None) -> int:
    """The CUDA ordinal of local rank ``info.local_rank``, given what every local rank of its node sees
    (``views``, see :func:`assign_gpus`): one rank per GPU however Slurm bound them. NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected" deep inside the first collective): one line here instead, naming
    the ranks, the GPUs and the variables they came from. Gloo (host staging) may share a GPU: ranks that
    see the same GPUs take turns over them."""
    environ = {} if environ is None else environ
    own = views[info.local_rank]
    if not own:
        raise LaunchEnvError(f"no GPU is visible to this rank ({_gpu_origin(environ, 0)})", rank=info.rank)
    assigned = assign_gpus(views)
    index = assigned[info.local_rank]
    if "nccl" not in backend:
        turn = sum(tuple(view) == tuple(own) for view in views[: info.local_rank])
        return turn % len(own) if index is None else index
    if None not in assigned:
        return index
    ranks, gpus = _sharers(views, assigned)
    raise LaunchEnvError(
        f"parallel.backend='nccl' puts {len(ranks)} ranks (local ranks {', '.join(map(str, ranks))}) on the "
        f"{len(gpus)} GPU(s) {', '.join(gpus)} of this node (this rank: {_gpu_origin(environ, len(own))}), and "
        "NCCL needs a GPU per rank: start at most one rank per GPU (srun --gpus-per-task=1, or --gpus-per-node "
        "equal to --ntasks-per-node), or set parallel.backend='gloo' to share GPUs",
        rank=info.rank)


def exchange_gpu_views(store, info: RankInfo, own: Sequence[str]) -> list[tuple[str, ...]]:
    """Every local rank's visible GPUs, through the rendezvous store (each rank sets its own, then reads its
    node's): what one process cannot know alone (srun's per-task binding, a wrapper's CUDA_VISIBLE_DEVICES)."""
    store.set(GPU_VIEW_KEY.format(node=info.node_rank, local=info.local_rank), json.dumps(list(own)))
    keys = [GPU_VIEW_KEY.format(node=info.node_rank, local=local) for local in range(info.local_size)]
    return [tuple(json.loads(store.get(key))) for key in keys]


def rank_device(info: RankInfo, backend: str, device: str = "auto", environ: Mapping[str, str] | None = None,
                views: Sequence[Sequence[str]] | None = None) -> torch.device:
    """This rank's device, made current: see :func:`gpu_index`. ``views`` (every local rank's visible GPUs)
    defaults to what this rank sees, shared by all its node's ranks (a launcher that binds nothing)."""
    import torch

    if select_device(device) == "cpu":
        return torch.device("cpu")
    environ = os.environ if environ is None else environ
    if views is None:
        views = [visible_gpus(environ, torch.cuda.device_count())] * info.local_size
    torch.cuda.set_device(gpu_index(info, views, backend, environ))
    return torch.device("cuda", torch.cuda.current_device())


def _reach_rendezvous(info: RankInfo, endpoint: Rendezvous, init_timeout_s: float) -> float:
    """Before torch's store: the endpoint's name resolved, and (other ranks) rank 0 listening there, within
    ``init_timeout_s``; returns the seconds left for the store. torch's client retries once more after its
    timeout, printing C++ stack frames, so an unreachable rank 0 took twice the timeout and 40 lines to say so."""
    deadline = time.monotonic() + init_timeout_s

    def refuse(why: str) -> RendezvousError:
        return RendezvousError(f"rank {info.rank} of {info.world_size} could not join the rendezvous at {endpoint} "
                               f"(chosen from {endpoint.source}) within {init_timeout_s:g} s: {why}",
                               launcher=info.launcher.value, job_id=info.job_id)

    try:
        socket.getaddrinfo(endpoint.addr, endpoint.port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise refuse(f"cannot resolve {endpoint.addr!r} ({exc})") from None
    while info.rank != 0:
        try:
            with socket.create_connection((endpoint.addr, endpoint.port),
                                          timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise refuse(f"nobody listens there (is rank 0 running? {exc.strerror or exc})") from None
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    return max(1.0, deadline - time.monotonic())


@contextlib.contextmanager
def _joining(info: RankInfo, endpoint: Rendezvous, init_timeout_s: float) -> Iterator[None]:
    """A store or process group that fails to form is one line naming this rank and the endpoint."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(
            f"rank {info.rank} of {info.world_size} could not join the rendezvous at {endpoint} "
            f"(chosen from {endpoint.source}) within {init_timeout_s:g} s: {first_line}",
            launcher=info.launcher.value,
            job_id=info.job_id,
        ) from exc


def _local_gpu_views(store, info: RankInfo, environ: Mapping[str, str], device: str) -> list | None:
    """Every local rank's visible GPUs where ranks compute on GPUs and share a node; else None."""
    import torch

    if info.local_size == 1 or select_device(device) != "cuda":
        return None
    return exchange_gpu_views(store, info, visible_gpus(environ, torch.cuda.device_count()))


def init(
    backend: str = "auto",
    init_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
    environ: Mapping[str, str] | None = None,
    device: str = "auto",
) -> World:
    """Create the default process group for this rank and return its view of the world.

    Ranks on GPUs first tell their node's other ranks, through the rendezvous store, which GPUs they
    see, and take one each (``gpu_index``). A rank killed by a fatal signal prints every thread's Python
    stack first (see ``dump_stacks_on_fatal_signals``)."""
    import torch.distributed as dist

    dump_stacks_on_fatal_signals()
    atexit.unregister(shutdown)  # once, however often a rank joins again (hvd.init after hvd.shutdown)
    atexit.register(shutdown)
    environ = os.environ if environ is None else environ
    info = detect_rank_info(environ)
    endpoint = rendezvous_from_env(info, environ)
    if endpoint is None:
        info, endpoint = _mpi_rendezvous(info)
    backend = select_backend(backend, device)
    left_s = _reach_rendezvous(info, endpoint, init_timeout_s)
    with _joining(info, endpoint, init_timeout_s):
        store = dist.TCPStore(
            endpoint.addr,
            endpoint.port,
            info.world_size,
            is_master=info.rank == 0,
            timeout=datetime.timedelta(seconds=left_s),
            wait_for_workers=True,
        )
        views = _local_gpu_views(store, info, environ, device)
    where = rank_device(info, backend, device, environ, views)
    with _joining(info, endpoint, init_timeout_s):
        dist.init_process_group(
            backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # NCCL: every communicator created with its group, by every rank at once (not at a first
            # point-to-point message that only two ranks of the group take part in)
            **({"device_id": where} if "nccl" in backend and where.type == "cuda" else {}),
        )
    return World(info=info, backend=backend, device=where, rendezvous=endpoint)


def dump_stacks_on_fatal_signals() -> bool:
    """Have a fatal signal (SIGABRT from a C++ library, SIGSEGV) print every thread's Python stack to
    stderr (``faulthandler``), so the launcher's "rank r was killed by SIGABRT" comes with where each
    thread was. Returns False, changing nothing, where stderr is no file (a notebook's, a test's
    capture): joining the job must not depend on it."""
    import faulthandler
    import io

    try:
        faulthandler.enable()
    except (AttributeError, ValueError, RuntimeError, io.UnsupportedOperation):
        return False
    return True


def shutdown() -> None:
    """Destroy the default process group if there is one; safe to call twice (``init`` also has it
    run at exit, so a script that never calls it ends the same way).

    First the GIL is released for a moment. Gloo's worker threads free a finished collective's
    tensors after the caller's wait has returned, and freeing a tensor Python created takes the
    GIL: a worker still waiting for it when the group is destroyed (which joins the workers, GIL
    held) hangs the rank, and when the interpreter finalizes, aborts it ("terminate called without
    an active exception"; caught under gdb in AsyncAlltoallWork's destructor, 1 run in 3-7 of a
    4-rank all-to-all loop ending in this call)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        time.sleep(WORKERS_SETTLE_S)
        dist.destroy_process_group()
