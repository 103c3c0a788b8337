"""Rank detection from launcher environments, as torchrun, mpirun, Hydra and srun export them."""

from __future__ import annotations

import re

import pytest

from hpc.errors import LaunchEnvError
from hpc.runtime.env import Launcher, RankInfo, detect_rank_info, with_hostnames

# Task 5 of `srun -N2 --ntasks-per-node=4` inside `sbatch -N2`: second node, second local task.
SRUN_STEP = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-a[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NODELIST": "gpu-a[01-02]",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "8",
    "SLURM_NPROCS": "8",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NODELIST": "gpu-a[01-02]",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURMD_NODENAME": "gpu-a02",
}

# What `sbatch -N2` leaves in the environment of anything started from the batch script.
SLURM_ALLOCATION = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "gpu-a[01-02]",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NNODES": "2",
    "SLURM_NTASKS": "2",
    "SLURM_TASKS_PER_NODE": "1(x2)",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}

# Global rank 5 of `torchrun --nnodes=2 --nproc-per-node=4`.
TORCHRUN = {
    "RANK": "5",
    "WORLD_SIZE": "8",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "4",
    "GROUP_RANK": "1",
    "GROUP_WORLD_SIZE": "2",
    "ROLE_RANK": "5",
    "MASTER_ADDR": "gpu-a01",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RUN_ID": "none",
}

# Rank 6 of `mpirun -np 8 --map-by ppr:4:node` over two nodes.
OPENMPI = {
    "OMPI_COMM_WORLD_RANK": "6",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "OMPI_COMM_WORLD_NODE_RANK": "2",
}

# Rank 3 of `mpiexec.hydra -n 4 -ppn 2` over two nodes.
HYDRA = {
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "PMI_FD": "7",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2",
}


def _without(environ: dict[str, str], *names: str) -> dict[str, str]:
    return {name: value for name, value in environ.items() if name not in names}


def _placement(info: RankInfo) -> tuple[int, int, int, int, int, int]:
    return (
        info.rank,
        info.world_size,
        info.local_rank,
        info.local_size,
        info.node_rank,
        info.num_nodes,
    )


# --- one realistic environment per launcher ---------------------------------------------


def test_srun_step_on_two_nodes() -> None:
    info = detect_rank_info(SRUN_STEP)
    assert info.launcher is Launcher.SLURM
    assert _placement(info) == (5, 8, 1, 4, 1, 2)
    assert info.hosts == ("gpu-a01", "gpu-a02")
    assert info.master_host == "gpu-a01"
    assert info.job_id == "4242"
    assert not info.is_mpi and not info.is_single


def test_srun_step_prefers_step_variables_over_the_allocation() -> None:
    # `srun -N1 -n2` inside a two-node allocation: the step, not the job, is the world.
    environ = {
        **SRUN_STEP,
        "SLURM_STEP_NODELIST": "gpu-a02",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
    }
    info = detect_rank_info(environ)
    assert _placement(info) == (1, 2, 1, 2, 0, 1)
    assert info.hosts == ("gpu-a02",)


def test_srun_with_uneven_tasks_per_node_uses_this_nodes_count() -> None:
    environ = {
        **SRUN_STEP,
        "SLURM_STEP_NUM_TASKS": "5",
        "SLURM_STEP_TASKS_PER_NODE": "3,2",
        "SLURM_PROCID": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
    }
    assert _placement(detect_rank_info(environ)) == (4, 5, 1, 2, 1, 2)


def test_srun_falls_back_to_job_level_variables() -> None:
    environ = _without(
        SRUN_STEP,
        "SLURM_STEP_NODELIST",
        "SLURM_STEP_NUM_NODES",
        "SLURM_STEP_NUM_TASKS",
        "SLURM_STEP_TASKS_PER_NODE",
    )
    info = detect_rank_info(environ)
    assert _placement(info) == (5, 8, 1, 4, 1, 2)
    assert info.hosts == ("gpu-a01", "gpu-a02")


def test_srun_with_old_variable_names_only() -> None:
    environ = {
        "SLURM_PROCID": "3",
        "SLURM_NPROCS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "n[7-8]",
        "SLURM_NTASKS_PER_NODE": "2",
    }
    info = detect_rank_info(environ)
    assert _placement(info) == (3, 4, 1, 2, 1, 2)
    assert info.hosts == ("n7", "n8")


def test_srun_derives_local_size_from_tasks_and_nodes_when_nothing_else_says() -> None:
    environ = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
    }
    info = detect_rank_info(environ)
    assert _placement(info) == (3, 4, 1, 2, 1, 2)
    assert info.hosts == ()
    assert info.master_host is None


def test_srun_without_node_count_or_list_is_one_node() -> None:
    environ = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NODEID": "0"}
    assert _placement(detect_rank_info(environ)) == (1, 2, 1, 2, 0, 1)


def test_torchrun() -> None:
    info = detect_rank_info(TORCHRUN)
    assert info.launcher is Launcher.TORCHRUN
    assert _placement(info) == (5, 8, 1, 4, 1, 2)
    assert info.hosts == ()
    assert info.job_id is None


def test_torchrun_without_group_variables_assumes_block_placement() -> None:
    environ = _without(TORCHRUN, "GROUP_RANK", "GROUP_WORLD_SIZE")
    assert _placement(detect_rank_info(environ)) == (5, 8, 1, 4, 1, 2)


def test_torchrun_without_local_world_size_assumes_one_node() -> None:
    environ = {"RANK": "3", "WORLD_SIZE": "4"}
    assert _placement(detect_rank_info(environ)) == (3, 4, 3, 4, 0, 1)


def test_torchrun_with_local_world_size_only_derives_local_rank() -> None:
    environ = {"RANK": "6", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert _placement(detect_rank_info(environ)) == (6, 8, 2, 4, 1, 2)


def test_open_mpi() -> None:
    info = detect_rank_info(OPENMPI)
    assert info.launcher is Launcher.OPENMPI
    assert info.is_mpi
    assert _placement(info) == (6, 8, 2, 4, 1, 2)
    assert info.hosts == ()


def test_open_mpi_with_uneven_last_node_rounds_node_count_up() -> None:
    environ = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "6", "OMPI_COMM_WORLD_RANK": "5"}
    assert _placement(detect_rank_info(environ))[4:] == (1, 2)


def test_hydra() -> None:
    info = detect_rank_info(HYDRA)
    assert info.launcher is Launcher.MPICH
    assert info.is_mpi
    assert _placement(info) == (3, 4, 1, 2, 1, 2)


def test_hydra_without_local_variables_assumes_one_node() -> None:
    environ = _without(HYDRA, "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    assert _placement(detect_rank_info(environ)) == (3, 4, 3, 4, 0, 1)


def test_single_process() -> None:
    info = detect_rank_info({"HOME": "/root", "PATH": "/usr/bin"})
    assert info == RankInfo(0, 1, 0, 1, 0, 1, (), Launcher.SINGLE, None)
    assert info.is_single and not info.is_mpi
    assert info.master_host is None


def test_rank_without_world_size_is_not_torchrun() -> None:
    assert detect_rank_info({"RANK": "3"}).launcher is Launcher.SINGLE


# --- precedence: the innermost launcher wins ---------------------------------------------


def test_torchrun_inside_slurm_is_torchrun() -> None:
    # One torchrun agent per node started by srun: SLURM_* describe the agents, not the ranks.
    environ = {**SLURM_ALLOCATION, "SLURM_PROCID": "1", "SLURM_NODEID": "1", **TORCHRUN}
    info = detect_rank_info(environ)
    assert info.launcher is Launcher.TORCHRUN
    assert _placement(info) == (5, 8, 1, 4, 1, 2)
    assert info.hosts == ()
    assert info.job_id == "4242"


def test_open_mpi_inside_slurm_is_open_mpi() -> None:
    info = detect_rank_info({**SLURM_ALLOCATION, **OPENMPI})
    assert info.launcher is Launcher.OPENMPI
    assert _placement(info) == (6, 8, 2, 4, 1, 2)
    assert info.hosts == ()
    assert info.job_id == "4242"


def test_hydra_inside_slurm_is_hydra() -> None:
    info = detect_rank_info({**SLURM_ALLOCATION, **HYDRA})
    assert info.launcher is Launcher.MPICH
    assert _placement(info) == (3, 4, 1, 2, 1, 2)


def test_srun_pmi2_is_slurm_because_srun_set_the_pmi_variables() -> None:
    # `srun --mpi=pmi2` exports PMI_RANK/PMI_SIZE but none of Hydra's MPI_LOCAL* variables.
    environ = {**SRUN_STEP, "PMI_RANK": "5", "PMI_SIZE": "8", "PMI_FD": "9"}
    info = detect_rank_info(environ)
    assert info.launcher is Launcher.SLURM
    assert _placement(info) == (5, 8, 1, 4, 1, 2)


def test_torchrun_wins_over_mpi() -> None:
    environ = {**OPENMPI, **HYDRA, **TORCHRUN}
    assert detect_rank_info(environ).launcher is Launcher.TORCHRUN


def test_open_mpi_wins_over_pmi() -> None:
    assert detect_rank_info({**HYDRA, **OPENMPI}).launcher is Launcher.OPENMPI


# --- job id -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"HPC_JOB_ID": "mine", "SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "r"}, "mine"),
        ({"SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "3", "SLURM_JOB_ID": "103"}, "100_3"),
        ({"SLURM_ARRAY_JOB_ID": "100", "SLURM_JOB_ID": "103"}, "103"),
        ({"SLURM_JOB_ID": "7", "TORCHELASTIC_RUN_ID": "r"}, "7"),
        ({"TORCHELASTIC_RUN_ID": "run-1"}, "run-1"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None),
        ({"HPC_JOB_ID": "", "SLURM_JOB_ID": "7"}, "7"),
        ({}, None),
    ],
)
def test_job_id(environ: dict[str, str], expected: str | None) -> None:
    assert detect_rank_info(environ).job_id == expected


def test_job_id_is_read_whatever_the_launcher() -> None:
    assert detect_rank_info({**OPENMPI, "HPC_JOB_ID": "mine"}).job_id == "mine"
    assert detect_rank_info({**TORCHRUN, "TORCHELASTIC_RUN_ID": "run-1"}).job_id == "run-1"


# --- malformed environments ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({**SRUN_STEP, "SLURM_PROCID": "abc"}, "SLURM_PROCID='abc' is not a non-negative integer"),
        ({**TORCHRUN, "RANK": "-1"}, "RANK='-1' is not a non-negative integer"),
        ({**TORCHRUN, "RANK": " 5"}, "RANK=' 5' is not a non-negative integer"),
        ({**TORCHRUN, "RANK": ""}, "RANK='' is not a non-negative integer"),
        ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE='8.0' is not a positive integer"),
        ({**TORCHRUN, "WORLD_SIZE": "0"}, "WORLD_SIZE='0' is not a positive integer"),
        ({**TORCHRUN, "LOCAL_RANK": "one"}, "LOCAL_RANK='one' is not a non-negative integer"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0' is not a positive integer"),
        ({**TORCHRUN, "GROUP_RANK": "x"}, "GROUP_RANK='x' is not a non-negative integer"),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "0"}, "GROUP_WORLD_SIZE='0' is not a positive integer"),
        ({**TORCHRUN, "RANK": "8"}, "RANK=8 is not below WORLD_SIZE=8"),
        ({**TORCHRUN, "LOCAL_RANK": "4"}, "LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
        ({**TORCHRUN, "LOCAL_WORLD_SIZE": "16"}, "LOCAL_WORLD_SIZE=16 exceeds WORLD_SIZE=8"),
        ({**TORCHRUN, "GROUP_RANK": "2"}, "GROUP_RANK=2 is not below GROUP_WORLD_SIZE=2"),
        ({**TORCHRUN, "GROUP_WORLD_SIZE": "9"}, "GROUP_WORLD_SIZE=9 exceeds WORLD_SIZE=8"),
        (
            {**_without(TORCHRUN, "GROUP_RANK"), "GROUP_WORLD_SIZE": "1"},
            "node rank 1 (RANK // local size) is not below GROUP_WORLD_SIZE=1",
        ),
        (
            {**_without(TORCHRUN, "LOCAL_WORLD_SIZE"), "LOCAL_RANK": "8"},
            "LOCAL_RANK=8 is not below local size 8 (WORLD_SIZE, as LOCAL_WORLD_SIZE is unset)",
        ),
        (
            _without(OPENMPI, "OMPI_COMM_WORLD_SIZE"),
            "OMPI_COMM_WORLD_SIZE is not set although OMPI_COMM_WORLD_RANK is",
        ),
        (
            {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "4"},
            "OMPI_COMM_WORLD_LOCAL_RANK=4 is not below OMPI_COMM_WORLD_LOCAL_SIZE=4",
        ),
        (
            {**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "four"},
            "OMPI_COMM_WORLD_LOCAL_SIZE='four' is not a positive integer",
        ),
        (_without(HYDRA, "PMI_SIZE"), "PMI_SIZE is not set although PMI_RANK is"),
        ({**HYDRA, "PMI_RANK": "4"}, "PMI_RANK=4 is not below PMI_SIZE=4"),
        ({**HYDRA, "MPI_LOCALNRANKS": "0"}, "MPI_LOCALNRANKS='0' is not a positive integer"),
        (
            _without(SRUN_STEP, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
            "none of SLURM_STEP_NUM_TASKS, SLURM_NTASKS, SLURM_NPROCS is set although SLURM_PROCID",
        ),
        ({**SRUN_STEP, "SLURM_STEP_NUM_TASKS": "0"}, "SLURM_STEP_NUM_TASKS='0' is not a positive"),
        (_without(SRUN_STEP, "SLURM_LOCALID"), "SLURM_LOCALID is not set although SLURM_PROCID"),
        (_without(SRUN_STEP, "SLURM_NODEID"), "SLURM_NODEID is not set although SLURM_PROCID"),
        ({**SRUN_STEP, "SLURM_LOCALID": "-1"}, "SLURM_LOCALID='-1' is not a non-negative integer"),
        ({**SRUN_STEP, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not below SLURM_STEP_NUM_TASKS=8"),
        ({**SRUN_STEP, "SLURM_NODEID": "2"}, "SLURM_NODEID=2 is not below SLURM_STEP_NUM_NODES=2"),
        (
            {**SRUN_STEP, "SLURM_LOCALID": "4"},
            "SLURM_LOCALID=4 is not below local size 4 (SLURM_STEP_TASKS_PER_NODE='4(x2)'",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_NUM_NODES": "9"},
            "SLURM_STEP_NODELIST='gpu-a[01-02]' names 2 nodes but SLURM_STEP_NUM_NODES=9",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_NODELIST": "gpu-a[01-02", "SLURM_STEP_NUM_NODES": "2"},
            "SLURM_STEP_NODELIST='gpu-a[01-02' is not a valid hostlist: unclosed '['",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_NODELIST": "gpu-a[02-01]"},
            "SLURM_STEP_NODELIST='gpu-a[02-01]' is not a valid hostlist: reversed range",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_NODELIST": ""},
            "SLURM_STEP_NODELIST='' is not a valid hostlist: empty hostlist expression",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x"},
            "SLURM_STEP_TASKS_PER_NODE='4(x' is not a valid tasks-per-node list",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE": "4(x3)"},
            "SLURM_STEP_TASKS_PER_NODE='4(x3)' lists 3 nodes but SLURM_STEP_NUM_NODES=2",
        ),
        (
            {**_without(SRUN_STEP, "SLURM_STEP_TASKS_PER_NODE"), "SLURM_TASKS_PER_NODE": "0"},
            "SLURM_TASKS_PER_NODE='0' is not a valid tasks-per-node list",
        ),
        (
            {**SRUN_STEP, "SLURM_STEP_NUM_NODES": "9", "SLURM_STEP_NODELIST": "n[1-9]"},
            "SLURM_STEP_NUM_NODES=9 exceeds SLURM_STEP_NUM_TASKS=8",
        ),
        (
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0",
                "SLURM_NTASKS_PER_NODE": "x",
            },
            "SLURM_NTASKS_PER_NODE='x' is not a positive integer",
        ),
    ],
)
def test_malformed_environment_names_the_variable(environ: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=re.escape(message)) as raised:
        detect_rank_info(environ)
    assert "\n" not in str(raised.value)


def test_error_is_one_line_even_for_values_with_newlines() -> None:
    with pytest.raises(LaunchEnvError, match=re.escape("RANK='1\\n2'")) as raised:
        detect_rank_info({"RANK": "1\n2", "WORLD_SIZE": "4"})
    assert "\n" not in str(raised.value)


def test_error_says_which_launcher_was_detected() -> None:
    with pytest.raises(LaunchEnvError) as raised:
        detect_rank_info({**OPENMPI, "OMPI_COMM_WORLD_RANK": "9"})
    assert raised.value.context == {"launcher": "openmpi"}


# --- with_hostnames -----------------------------------------------------------------------

ROUND_ROBIN = ["a", "b", "a", "b"]


@pytest.mark.parametrize(
    ("rank", "node_rank", "local_rank"),
    [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)],
)
def test_with_hostnames_handles_interleaved_placement(
    rank: int, node_rank: int, local_rank: int
) -> None:
    mpi = {**OPENMPI, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": str(rank)}
    info = with_hostnames(detect_rank_info({**mpi, "HPC_JOB_ID": "j1"}), ROUND_ROBIN)
    assert info.hosts == ("a", "b")
    assert (info.node_rank, info.num_nodes) == (node_rank, 2)
    assert (info.local_rank, info.local_size) == (local_rank, 2)
    assert (info.rank, info.world_size, info.launcher, info.job_id) == (
        rank,
        4,
        Launcher.OPENMPI,
        "j1",
    )
    assert info.master_host == "a"


def test_with_hostnames_handles_uneven_nodes() -> None:
    info = detect_rank_info({"PMI_RANK": "3", "PMI_SIZE": "4"})
    info = with_hostnames(info, ("n2", "n2", "n2", "n1"))
    assert info.hosts == ("n2", "n1")
    assert _placement(info) == (3, 4, 0, 1, 1, 2)


def test_with_hostnames_on_one_node() -> None:
    info = with_hostnames(detect_rank_info({}), ["localhost"])
    assert info.hosts == ("localhost",)
    assert _placement(info) == (0, 1, 0, 1, 0, 1)


def test_with_hostnames_rejects_a_list_of_the_wrong_length() -> None:
    info = detect_rank_info(HYDRA)
    with pytest.raises(ValueError, match="got 3 hostnames for a world of 4 ranks"):
        with_hostnames(info, ["a", "a", "b"])
