"""Run a function on N Gloo ranks in separate processes: the helper every multi-rank test uses.

Ranks are forked from a forkserver that has already imported torch, so a rank
costs a fork instead of a 2-second import (4 imports at once take ~7 s on 2 cores);
and torch._dynamo, which the first optimizer a rank builds imports (``torch.optim``'s
``_disable_dynamo``): another ~1.5 s of CPU per rank, ~6 s of an 8-rank launch on 2 cores.
Each rank joins through ``hpc.runtime.bootstrap.init`` exactly as a launched rank does,
with one torch thread. The first failure is re-raised naming its rank; a rank
that dies without reporting, or a run past its timeout, fails the test too.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

from hpc.runtime.bootstrap import free_port


class RankError(AssertionError):
    pass


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


def _rank_main(fn: Callable, rank: int, n: int, port: int, args: tuple, results: Any, device: str = "cpu",
               backend: str = "gloo") -> None:
    import torch

    from hpc.runtime import bootstrap
    from tests import nccl_rules

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    environ = {
        "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
    }
    os.environ.update(environ)  # as a launcher would: code that reads the environment sees this rank
    if backend == nccl_rules.BACKEND:
        nccl_rules.register()
    try:
        world = bootstrap.init(backend, init_timeout_s=30, timeout_s=60, environ=environ, device=device)
        try:
            # plain pickle: a queue's tensors would travel as file descriptors that live only while this
            # process does, and it may exit before the test takes them (FileNotFoundError in the test)
            results.put((rank, True, pickle.dumps(fn(world, *args))))
        finally:
            nccl_rules.leave()
            bootstrap.shutdown()
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def run_ranks(n: int, fn: Callable, *args: Any, timeout: float = 120.0, device: str = "cpu",
              backend: str | None = None) -> list[Any]:
    """``fn(world, *args)`` on ranks 0..n-1; returns each rank's result in rank order. ``device="cuda"``: the
    ranks share the GPU (``world.device``), over Gloo. ``backend``: tests/nccl_rules.py's ``BACKEND`` runs them
    under NCCL's rules; unnamed, ``HPC_TEST_BACKEND`` (default gloo), so that any test file runs under the rules
    in one go (``HPC_TEST_BACKEND=ncclrules pytest tests/test_zero.py``, docs/TESTING.md)."""
    backend = backend or os.environ.get("HPC_TEST_BACKEND", "gloo")
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, n, port, args, results, device, backend), daemon=True)
             for r in range(n)]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(collected) < n:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in collected and p.exitcode not in (None, 0)]
                if dead:
                    raise RankError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(n)) - set(collected))
                    raise RankError(f"ranks {missing} did not finish within {timeout:g} s") from None
                continue
            if not ok:
                raise RankError(f"rank {rank} failed:\n{value}")
            collected[rank] = pickle.loads(value)
        finished = True
    finally:
        for proc in procs:  # after a failure the others may wait on it forever: stop them at once
            proc.join(timeout=5 if finished else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(n)]


_MPI_RANK = """
import importlib, pickle, sys
import torch
import hpc
torch.set_num_threads(1)
world = hpc.init("gloo")
module, name = sys.argv[1].split(":")
result = getattr(importlib.import_module(module), name)(world, *pickle.loads(bytes.fromhex(sys.argv[2])))
with open(f"{sys.argv[3]}/rank-{world.rank}.pickle", "wb") as handle:
    pickle.dump(result, handle)
hpc.shutdown()
"""


def run_under_mpirun(n: int, fn: Callable, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(world, *args)`` on n Gloo ranks started by Open MPI's mpirun (for what only MPI-started ranks
    can do: the mpi4py transport); returns each rank's result by rank. ``fn`` must be importable by name."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from hpc.runtime import launch

    with tempfile.TemporaryDirectory() as out:
        argv = (sys.executable, "-c", _MPI_RANK, f"{fn.__module__}:{fn.__name__}", pickle.dumps(args).hex(), out)
        command = launch.mpirun_command(n, argv, os.environ, is_root=os.geteuid() == 0)
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=Path(__file__).parents[1])
        assert done.returncode == 0, done.stderr
        return [pickle.loads((Path(out) / f"rank-{rank}.pickle").read_bytes()) for rank in range(n)]
