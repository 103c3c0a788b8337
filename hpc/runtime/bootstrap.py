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
import datetime
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc.errors import LaunchEnvError, RendezvousError
from hpc.runtime.env import Launcher, RankInfo, detect_rank_info, with_hostnames

if TYPE_CHECKING:
    import torch

SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 20000
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


def rank_device(info: RankInfo, backend: str, device: str = "auto") -> torch.device:
    """This rank's device, made current: GPU ``local_rank`` modulo the visible GPUs. NCCL refuses two ranks
    on one GPU ("Duplicate GPU detected" deep inside the first collective): one line here instead."""
    import torch

    if select_device(device) == "cpu":
        return torch.device("cpu")
    gpus = torch.cuda.device_count()
    if "nccl" in backend and info.local_size > gpus:
        raise LaunchEnvError(
            f"parallel.backend='nccl' puts {info.local_size} ranks on the {gpus} GPU(s) of this node, and NCCL "
            "needs a GPU per rank: start at most one rank per GPU, or set parallel.backend='gloo' to share GPUs",
            rank=info.rank)
    torch.cuda.set_device(info.local_rank % gpus)
    return torch.device("cuda", torch.cuda.current_device())


def init(
    backend: str = "auto",
    init_timeout_s: float = 60.0,
    timeout_s: float = 300.0,
    environ: Mapping[str, str] | None = None,
    device: str = "auto",
) -> World:
    """Create the default process group for this rank and return its view of the world.

    A rank killed by a fatal signal prints every thread's Python stack first (see
    ``dump_stacks_on_fatal_signals``)."""
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
    where = rank_device(info, backend, device)
    try:
        store = dist.TCPStore(
            endpoint.addr,
            endpoint.port,
            info.world_size,
            is_master=info.rank == 0,
            timeout=datetime.timedelta(seconds=init_timeout_s),
            wait_for_workers=True,
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
            # NCCL: every communicator created with its group, by every rank at once (not at a first
            # point-to-point message that only two ranks of the group take part in)
            **({"device_id": where} if "nccl" in backend else {}),
        )
    except (RuntimeError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(
            f"rank {info.rank} of {info.world_size} could not join the rendezvous at {endpoint} "
            f"(chosen from {endpoint.source}) within {init_timeout_s:g} s: {first_line}",
            launcher=info.launcher.value,
            job_id=info.job_id,
        ) from exc
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
