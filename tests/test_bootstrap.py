import socket
import time

import pytest

from hpc.errors import LaunchEnvError, RendezvousError
from hpc.runtime import bootstrap
from hpc.runtime.env import detect_rank_info

SLURM_STEP = {
    "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_JOB_NUM_NODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0",  # srun always exports the step id
}


def test_master_variables_win() -> None:
    env = {**SLURM_STEP, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"}
    endpoint = bootstrap.rendezvous_from_env(detect_rank_info(env), env)
    assert (endpoint.addr, endpoint.port, endpoint.source) == ("10.1.2.3", 29500, "env")


def test_slurm_uses_first_host_and_a_job_derived_port() -> None:
    endpoint = bootstrap.rendezvous_from_env(detect_rank_info(SLURM_STEP), SLURM_STEP)
    assert endpoint.addr == "gpu-a01"
    assert endpoint.port == bootstrap.slurm_port("123456")
    assert endpoint.source == "slurm"


def test_slurm_ports_differ_between_jobs_and_stay_in_range() -> None:
    ports = {bootstrap.slurm_port(str(job)) for job in range(1000, 1100)}
    assert len(ports) == 100
    assert all(1024 < p < 32768 for p in ports)  # below Linux's default ephemeral range (32768-60999)
    assert not set(map(bootstrap.slurm_port, map(str, range(100_000)))) & set(bootstrap.CHOSEN_PORTS)
    assert bootstrap.slurm_port("77_3") == bootstrap.slurm_port("773")


def test_mpi_defers_to_a_broadcast() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert bootstrap.rendezvous_from_env(detect_rank_info(env), env) is None


def test_torchrun_without_master_is_an_error() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2"}
    with pytest.raises(LaunchEnvError, match="MASTER_ADDR/MASTER_PORT are not set"):
        bootstrap.rendezvous_from_env(detect_rank_info(env), env)


def test_bad_master_port_names_the_variable() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "x", "MASTER_PORT": "http"}
    with pytest.raises(LaunchEnvError, match="MASTER_PORT='http'"):
        bootstrap.rendezvous_from_env(detect_rank_info(env), env)


def test_rank_that_cannot_rendezvous_fails_fast_naming_itself_and_the_address() -> None:
    port = bootstrap.free_port()  # nobody listens here
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        bootstrap.init("gloo", init_timeout_s=5, environ=env)
    assert time.monotonic() - started < 9  # torch's store alone retried after its timeout: twice as long
    message = str(info.value)
    assert "rank 1 of 2" in message and f"127.0.0.1:{port}" in message and "nobody listens there" in message
    assert "\n" not in message


def test_a_rendezvous_host_that_does_not_resolve_is_named_at_once() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no.such.host.invalid", "MASTER_PORT": "29511"}
    started = time.monotonic()
    with pytest.raises(RendezvousError) as info:
        bootstrap.init("gloo", init_timeout_s=30, environ=env)
    assert time.monotonic() - started < 10 and "cannot resolve 'no.such.host.invalid'" in str(info.value)


def test_shutdown_without_init_is_harmless() -> None:
    bootstrap.shutdown()
    bootstrap.shutdown()



def test_shutdown_lets_a_thread_waiting_for_the_gil_finish_before_the_group_goes(monkeypatch) -> None:
    """What a Gloo worker does after a collective (free its Python tensors: take the GIL) must happen before
    destroy_process_group joins the workers or the interpreter finalizes (caught under gdb: an abort at exit)."""
    import threading

    import torch.distributed as dist

    released, freed, seen_at_destroy = threading.Lock(), [], []
    released.acquire()

    def worker() -> None:
        with released:  # blocked without the GIL, like a worker inside a collective
            freed.append(True)  # needs the GIL, like freeing a tensor Python made

    thread = threading.Thread(target=worker)
    thread.start()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen_at_destroy.append(bool(freed)))
    released.release()  # the collective completes; the main thread goes on holding the GIL
    bootstrap.shutdown()
    thread.join()
    assert seen_at_destroy == [True]


def test_stacks_on_fatal_signals_need_a_real_stderr_but_joining_does_not(monkeypatch, tmp_path) -> None:
    import faulthandler
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a notebook's or a capture's: no file descriptor
    assert bootstrap.dump_stacks_on_fatal_signals() is False
    with open(tmp_path / "stderr", "w") as real:
        monkeypatch.setattr(sys, "stderr", real)
        assert bootstrap.dump_stacks_on_fatal_signals() is True and faulthandler.is_enabled()
        faulthandler.disable()


def _ephemeral_range() -> range:
    try:
        with open(bootstrap.EPHEMERAL_RANGE) as handle:
            first, last = map(int, handle.read().split())
    except OSError:
        pytest.skip("no ephemeral port range to read (not Linux)")
    return range(first, last + 1)


def test_a_chosen_port_is_free_and_one_the_kernel_never_hands_out() -> None:
    """The kernel gives ports of its ephemeral range to every connection and ``bind(0)`` (Gloo's dozens) between
    our choice and the store's bind; a port below that range none of them can take."""
    ephemeral = _ephemeral_range()
    if ephemeral.start <= bootstrap.CHOSEN_PORTS.start:
        pytest.skip(f"the kernel's ephemeral ports start at {ephemeral.start}")
    for _ in range(20):
        port = bootstrap.free_port()
        assert port in bootstrap.CHOSEN_PORTS and port not in ephemeral
        with socket.socket() as store:
            store.bind(("", port))
            store.listen()


def test_a_port_in_use_is_passed_over_and_without_a_range_the_kernel_picks(monkeypatch, tmp_path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(bootstrap, "CHOSEN_PORTS", range(busy, busy + 1))
        monkeypatch.setattr(bootstrap, "EPHEMERAL_RANGE", str(ranges))
        ranges.write_text(f"{busy + 1} {busy + 2}\n")
        assert bootstrap.free_port() != busy  # the one port to choose from is in use
        ranges.unlink()
        assert bootstrap.free_port() != busy  # no range to read (not Linux)


def test_mpi_variables_that_disagree_with_mpi_comm_world_are_one_line() -> None:
    """Open MPI's variables left in a shell (or set by hand) with one process: `got 1 hostnames for a world of 2
    ranks` raised bare from the hostname exchange."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    code = "from hpc.runtime import bootstrap; bootstrap.init()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert ("LaunchEnvError: the environment says 2 MPI ranks (Open MPI's or MPICH's variables) but MPI_COMM_WORLD "
            "has 1: start the ranks with mpirun, or unset those variables") in done.stderr, done.stderr
