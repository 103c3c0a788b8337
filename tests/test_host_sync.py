"""A training step reads nothing from the device: its numbers are read after the next step is queued.

On a GPU every host read of a device value (``.item()``, ``bool(tensor)``, a range check) waits for the
queue to drain, and the GPU then idles while the host launches what comes next. Such reads go through
aten's ``_local_scalar_dense`` on any device, so the CPU counts them, and the ops whose output size is a
device value (``nonzero``, ``bincount``): during a step of each example model (SGD, whose update reads
nothing; clipping on), ``StepRunner.run`` must make none. Its report (loss, gradient norm, MoE totals) is
copied to the host behind the step's work and read by the trainer once the next step is queued
(``jobs/train/loop.py`` ``StepReport``); until session 15 the step read its loss sum at its end, as a loop's
``loss.item()`` does. One transformers helper asked for the mask with position ids read each layer's
positions back for packed sequences (16 reads a step of the bench Llama); torch's ``one_hot`` range check
read the router's choices twice per MoE layer.

What the CPU cannot see, a GPU does: torch's synchronization debug mode warns at any synchronizing call
(a ``.tolist()``, ``nonzero``, ``bincount``, a pageable copy, a stream synchronization). There every
synchronization of a step must be an MoE layer's one read of its kept choices per expert, which
sizes its experts' rows (and, under EP, its exchanges), as Megatron's dispatcher reads them; it made four
(``nonzero``, ``bincount`` and ``tolist`` in the dispatch, ``bincount`` again in its statistics) until session 14.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest

from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = ["gpt.toml", "llama.toml", "gpt_moe.toml"]
# a host read of a device value, and the ops whose output size is one on a GPU (each reads the device first)
SYNCING_OPS = ("_local_scalar_dense", "nonzero", "bincount")
SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda's warn_or_error_on_sync


def _ours(frames) -> list[str]:
    """The frames of the project's own code (not the tests'), as path:function."""
    return [f"{Path(f.filename).relative_to(REPO)}:{f.name}" for f in frames
            if f.filename.startswith(str(REPO)) and "/tests/" not in f.filename]


def _step_runner(world, example: str, run_dir: str, layout=(1, 1, 1), device: str = "cpu", optimizer="sgd"):
    """An example's StepRunner (``optimizer``, clipping on) on ``device``, its first step run; and its optimizer."""
    from hpc.config import load_spec
    from hpc.observe.probe import Probe
    from hpc.runtime.mesh import MeshShape, build_mesh
    from jobs.train.loop import StepRunner, build_data_parallel_optimizer
    from jobs.train.workloads import Workload

    dp, tp, pp = layout
    spec = load_spec(REPO / "jobs" / "examples" / example,
                     [f"job.run_dir={run_dir}", f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}",
                      "parallel.ep=1", f"train.optimizer={optimizer}", "train.grad_clip=1.0",
                      f"parallel.device={device}"])
    mesh = build_mesh(MeshShape(*layout), world.rank, world.device if device == "cuda" else "cpu")
    workload = Workload(spec, mesh)
    optimizer = build_data_parallel_optimizer(spec, workload.model, mesh, Probe(), exclude=workload.expert_params)
    runner = StepRunner(spec, workload, mesh, Probe(), optimizer)
    runner.run(0)
    return runner, optimizer


def _host_reads(world, example: str, run_dir: str, layout=(1, 1, 1), optimizer="sgd") -> list[str]:
    """Where the second step read device values from the host (the innermost frame of ours, each read), then
    the test's own read of the step's report."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sites: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in SYNCING_OPS:
                self.sites.append((_ours(traceback.extract_stack()) or ["?"])[-1])
            return func(*args, **(kwargs or {}))

    runner, optimizer = _step_runner(world, example, run_dir, layout, optimizer=optimizer)
    reads = Reads()
    with reads:
        report = runner.run(1)
        report.numbers[0].item()  # the control: a read the mode must see ("?": the test's own)
    optimizer.close()
    assert report.outcome().loss > 0
    return reads.sites


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_step_reads_nothing_from_the_device(example, tmp_path) -> None:
    if example == "llama.toml":
        pytest.importorskip("transformers")
    (sites,) = run_ranks(1, _host_reads, example, str(tmp_path), timeout=300)
    assert sites == ["?"], sites


@pytest.mark.parametrize("layout", [(2, 1, 1), (1, 2, 1), (1, 1, 2)], ids=["dp2", "tp2", "pp2"])
def test_under_each_parallelism_a_step_reads_nothing_from_the_device(layout, tmp_path) -> None:
    for sites in run_ranks(2, _host_reads, "gpt.toml", str(tmp_path), layout, timeout=300):
        assert sites == ["?"], sites


@pytest.mark.parametrize("optimizer", ["lars", "lamb"])
def test_lars_and_lamb_take_their_trust_ratios_without_reading_the_device(optimizer, tmp_path) -> None:
    """Their layer norms, whole over TP, and the ratios stay on the device (they read them once per step
    until session 15)."""
    for sites in run_ranks(2, _host_reads, "gpt.toml", str(tmp_path), (1, 2, 1), optimizer, timeout=300):
        assert sites == ["?"], sites


def _gpu_syncs(world, example: str, run_dir: str) -> tuple[list[list[str]], int]:
    """On the GPU, the second step under torch's synchronization debug mode set to warn, then the test's own
    synchronization: for each synchronizing call, in order, our frames where it came from (which also catches
    what no host read shows: a ``.tolist()``, a pageable copy, a stream synchronization); and the model's MoE
    layers."""
    import warnings

    import torch

    from jobs.models.moe import moe_layers

    runner, optimizer = _step_runner(world, example, run_dir, device="cuda")
    torch.cuda.synchronize()
    sites: list[list[str]] = []

    def record(message, *args, **kwargs) -> None:
        if str(message).startswith(SYNC_WARNING):  # not the mode's own "prototype feature" warning as it is set
            sites.append(_ours(traceback.extract_stack()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            report = runner.run(1)
            torch.zeros((), device=world.device).item()  # the control: a synchronization the mode must see
        finally:
            torch.cuda.set_sync_debug_mode("default")
    optimizer.close()
    assert report.outcome().loss > 0
    return sites, len(moe_layers(runner.workload.model))


@pytest.mark.cuda
@pytest.mark.parametrize("example", EXAMPLES)
def test_on_the_gpu_a_step_synchronizes_only_once_per_moe_layer(example, tmp_path) -> None:
    if example == "llama.toml":
        pytest.importorskip("transformers")
    ((sites, moe),) = run_ranks(1, _gpu_syncs, example, str(tmp_path), timeout=300, device="cuda")
    assert [frames[-1] if frames else "the test's" for frames in sites] == ["jobs/models/moe.py:_dispatch"] * moe + [
        "the test's"], sites


class _EventNotYetPassed:
    """A GPU's timed event as the host sees it while the device still runs: not done until waited for; step
    ``step`` ends at ``DEVICE_STEP_S`` * (step + 1) on the device's clock."""

    def __init__(self, log: list, step: int) -> None:
        self.log, self.step = log, step

    def synchronize(self) -> None:
        self.log.append(("read", self.step))

    def elapsed_time(self, end: _EventNotYetPassed) -> float:
        return (end.step - self.step) * DEVICE_STEP_S * 1e3  # milliseconds, as torch.cuda.Event's


DEVICE_STEP_S = 7.0  # far from any host time here


def _spec(run_dir: str, name: str, **checkpoint):
    from hpc.config import spec_from_dict

    return spec_from_dict({"job": {"run_dir": run_dir, "name": name, "seed": 3},
                           "model": {"hidden_sizes": [16]}, "data": {"batch_size": 16},
                           "train": {"steps": 5, "lr": 0.01, "log_every": 100}, "checkpoint": checkpoint})


def _order_of_work(world, run_dir: str) -> tuple[list, list[dict]]:
    """The trainer's queued steps, report reads and checkpoint saves in order, with each step's report left
    pending as a GPU's; and the metrics it wrote."""
    import dataclasses
    import json

    from hpc.run_session import RunSession
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import StepRunner, train

    log: list = []
    run, save = StepRunner.run, RunSession.save

    def queued(self, step):
        log.append(("queued", step))
        return dataclasses.replace(run(self, step), ready=_EventNotYetPassed(log, step))

    def saved(self, done, state, **attrs):
        log.append(("saved", done, attrs.get("loss")))
        return save(self, done, state, **attrs)

    StepRunner.run, RunSession.save = queued, saved
    train(_spec(run_dir, "order", every_steps=3), world, build_mesh(resolve_layout("auto", 1, 1, world.size),
                                                                     world.rank))
    return log, [json.loads(line) for line in (Path(run_dir) / "order" / "metrics.jsonl").open()]


def test_the_trainer_reads_a_step_once_the_next_is_queued_and_before_a_checkpoint(tmp_path) -> None:
    """On a GPU the host queues step n + 1 before it waits for step n's numbers, so the device never idles
    between steps; a checkpoint waits for its step's loss (saved with it) and the next step's time leaves the
    save out. A step's time is the device's between its end and the one before's (the host sees two end at
    once at times), timed on the host for the first step and the first after a save."""
    ((log, metrics),) = run_ranks(1, _order_of_work, str(tmp_path), timeout=120)
    losses = {record["step"]: record["loss"] for record in metrics}
    assert log == [("queued", 0), ("queued", 1), ("read", 0), ("queued", 2), ("read", 1), ("read", 2),
                   ("saved", 3, losses[3]), ("queued", 3), ("queued", 4), ("read", 3), ("read", 4),
                   ("saved", 5, losses[5])]
    assert sorted(losses) == [1, 2, 3, 4, 5]
    # from the device's clock between two steps' events; on the host's for the first and the first after a save
    times = [record["step_time_s"] for record in metrics]
    assert [t == DEVICE_STEP_S for t in times] == [False, True, True, False, True], times
    assert 0 < times[0] < DEVICE_STEP_S and 0 < times[3] < DEVICE_STEP_S


def test_the_moe_statistics_are_gathered_on_the_device_with_nothing_copied_from_the_host() -> None:
    """``MoEStats.vector`` on the meta device, a stand-in for a GPU: no op may take a host tensor, nor make a
    tensor of a Python number, as an element assigned one does (on a GPU, ``row[-1] = 2.0`` makes a CPU tensor of
    2.0 and copies it in, which waits for the device; ``fill_`` passes the number to the kernel)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from jobs.models.moe import MoEStats

    class HostOperands(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            operands = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            if func.overloadpacket.__name__ == "scalar_tensor" or any(
                    isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in operands):
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    meta = torch.device("meta")
    stats = MoEStats(4)
    stats.add(torch.zeros(4, dtype=torch.int64, device=meta), 32, torch.zeros((), device=meta))
    for fresh in (MoEStats(4), stats):  # nothing routed yet (aux sum a number), and one forward's worth
        with HostOperands() as seen:
            row = fresh.vector(meta)
        assert seen.ops == [] and row.shape == (8,) and row.device == meta, seen.ops


def _out_of_memory_at_step_3(world, run_dir: str) -> tuple[str, list[int]]:
    """A run whose fourth step runs out of device memory while the third is pending, as on a GPU: the error's
    line, and the steps metrics.jsonl reported."""
    import dataclasses
    import json

    import torch

    from hpc.errors import DeviceOutOfMemoryError
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import StepRunner, train

    run = StepRunner.run

    def queued(self, step):
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return dataclasses.replace(run(self, step), ready=_EventNotYetPassed([], step))

    StepRunner.run = queued
    try:
        train(_spec(run_dir, "oom"), world, build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank))
    except DeviceOutOfMemoryError as error:
        said = str(error)
    return said, [json.loads(line)["step"] for line in (Path(run_dir) / "oom" / "metrics.jsonl").open()]


def test_an_out_of_memory_is_one_error_after_the_steps_before_it_are_reported(tmp_path) -> None:
    ((said, steps),) = run_ranks(1, _out_of_memory_at_step_3, str(tmp_path), timeout=120)
    assert "out of memory" in said and "rank 0" in said, said
    assert steps == [1, 2, 3]  # the third, pending when the fourth failed, too
