"""Checkpoints and devices: the asynchronous save's reused host buffers, the RNG of the CPU and the GPU,
and tensors loaded onto the device of what they are copied into (a GPU checkpoint on CPUs and back).

The tests marked ``cuda`` need a GPU and are skipped without one; the others check on the CPU
what does not (buffer reuse without pinning, the RNG where CUDA is absent, the device each
optimizer tensor is created on, with the meta device standing in for a GPU).
"""

from __future__ import annotations

import pytest
import torch

from hpc.checkpoint.save import HostStaging
from hpc.checkpoint.state import CUDA_RNG, RNG, restore_rng, rng_state
from tests.ranks import run_ranks


def _staged(staging: HostStaging, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    staging.begin()
    copies = {path: staging.copy(path, tensor) for path, tensor in tensors.items()}
    staging.wait()
    return copies


def test_host_buffers_are_reused_reallocated_on_a_new_shape_or_dtype_and_dropped_when_unused() -> None:
    staging = HostStaging()
    first = _staged(staging, {"a": torch.arange(6.0), "b": torch.ones(2, 2), "c": torch.zeros(3)})
    second = _staged(staging, {"a": torch.arange(6.0) * 2, "b": torch.ones(4), "c": torch.zeros(3, dtype=torch.int64)})
    assert second["a"].data_ptr() == first["a"].data_ptr() and torch.equal(second["a"], torch.arange(6.0) * 2)
    assert second["b"].shape == (4,) and second["c"].dtype == torch.int64
    assert not any(buffer.is_pinned() for buffer, _ in staging.buffers.values())  # CPU tensors: ordinary memory
    _staged(staging, {"a": torch.arange(6.0)})
    assert set(staging.buffers) == {"a"}  # what a save no longer writes is freed
    assert staging.buffers["a"][0].data_ptr() == first["a"].data_ptr()


def test_rng_without_cuda_saves_and_restores_the_cpu_generator_only(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    state = rng_state()
    assert set(state) == {RNG}
    expected = torch.rand(3)
    torch.rand(5)

    def refuse(_state):
        raise AssertionError("a CPU resume must leave CUDA alone")

    monkeypatch.setattr(torch.cuda, "set_rng_state", refuse)
    restore_rng({**state, CUDA_RNG: torch.zeros(16, dtype=torch.uint8)})  # a GPU checkpoint resumed on CPUs
    assert torch.equal(torch.rand(3), expected)


def test_a_cpu_checkpoint_leaves_the_gpu_generator_as_seeded(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", calls.append)
    restore_rng({RNG: torch.get_rng_state()})
    assert calls == []
    restore_rng({RNG: torch.get_rng_state(), CUDA_RNG: torch.zeros(16, dtype=torch.uint8)})
    assert len(calls) == 1


def _model(device: str, width: int = 6, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 4)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        inputs = torch.linspace(-1, 1, 40).reshape(5, 8).to(next(model.parameters()).device) * (step + 1)
        optimizer.zero_grad()
        model(inputs).square().sum().backward()
        optimizer.step()


def _save_then_load_on_meta(world, root: str) -> dict[str, str]:
    """Save a CPU model and Adam; load into a meta-device model (the GPU's stand-in): the devices handed over."""
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, open_checkpoint
    from hpc.checkpoint.state import load_state, state_pieces

    model, optimizer = _model("cpu")
    _train(model, optimizer, 2)
    Checkpointer(root, dist.group.WORLD).save(2, state_pieces(model, optimizer), rng_state())
    meta, meta_optimizer = _model("meta")
    handed: dict[str, str] = {}
    load_state_dict = meta_optimizer.load_state_dict

    def record(state_dict):
        handed.update({f"{i}/{k}": v.device.type for i, s in state_dict["state"].items() for k, v in s.items()})
        return load_state_dict(state_dict)

    meta_optimizer.load_state_dict = record
    load_state(open_checkpoint(f"{root}/step-00000002"), meta, meta_optimizer)
    return handed


def test_optimizer_state_is_created_on_its_parameters_device_and_step_on_the_cpu(tmp_path) -> None:
    handed = run_ranks(1, _save_then_load_on_meta, str(tmp_path), timeout=60)[0]
    assert handed and {k: v for k, v in handed.items() if k.endswith("/step")} == {f"{i}/step": "cpu" for i in range(4)}
    assert {v for k, v in handed.items() if not k.endswith("/step")} == {"meta"}


SPLIT = {"0.weight": 0, "0.bias": 0, "2.weight": 1}  # a TP=2 layout: the hidden layer's units split


def _gpu_save(world, root: str) -> dict:
    """dp=2 on the GPU: train, save asynchronously twice (pinned buffers reused), return what a resume must see."""
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer
    from hpc.checkpoint.state import state_pieces

    model, optimizer = _model("cuda")
    _train(model, optimizer, 3)
    saver = Checkpointer(root, dist.group.WORLD, async_save=True)
    saver.save(2, state_pieces(model, optimizer), rng_state())
    saver.finalize()
    buffers = {path: (buffer.data_ptr(), buffer.is_pinned()) for path, (buffer, _) in saver._staging.buffers.items()}
    torch.cuda.manual_seed(1234 + world.rank)  # each rank's generator its own
    saver.save(3, state_pieces(model, optimizer), rng_state())
    after = torch.randn(4, device="cuda").cpu()
    saver.finalize()
    dist.barrier()
    reused = buffers == {path: (b.data_ptr(), b.is_pinned()) for path, (b, _) in saver._staging.buffers.items()}
    on_cpu = {path for path in buffers if path.endswith("/step") or "/rng/" in path}  # step counts, RNG states
    assert reused and all(pinned == (path not in on_cpu) for path, (_, pinned) in buffers.items()), buffers
    return {"after": after, "state": {k: v.cpu() for k, v in model.state_dict().items()}}


def _load(index, device: str, tp_rank: int | None = None):
    from hpc.checkpoint.state import load_state

    split, tp_size = (SPLIT, 2) if tp_rank is not None else ({}, 1)
    model, optimizer = _model(device, width=3 if tp_rank is not None else 6, seed=99)
    load_state(index, model, optimizer, split, tp_rank or 0, tp_size)
    for param in model.parameters():
        for key, value in optimizer.state[param].items():
            assert value.device.type == ("cpu" if key == "step" else device), (key, value.device)
    return model, optimizer


def _gpu_to_cpu_and_back(world, root: str) -> None:
    """A GPU checkpoint loads on CPUs under dp=2 and tp=2, and on the GPU again; the GPU RNG comes back."""
    from hpc.checkpoint import load_rank_state, open_checkpoint

    saved = _gpu_save(world, root)
    index = open_checkpoint(f"{root}/step-00000003")
    cpu, _ = _load(index, "cpu")
    for name, tensor in cpu.state_dict().items():
        assert torch.equal(tensor, saved["state"][name]), name
    tp, _ = _load(index, "cpu", tp_rank=world.rank)
    for name, tensor in tp.state_dict().items():
        dim = SPLIT.get(name)
        whole = saved["state"][name]
        block = whole if dim is None else whole.narrow(dim, world.rank * tensor.shape[dim], tensor.shape[dim])
        assert torch.equal(tensor, block), name
    gpu, gpu_optimizer = _load(index, "cuda")
    torch.cuda.manual_seed(0)
    restore_rng(load_rank_state(index, world.rank))
    assert torch.equal(torch.randn(4, device="cuda").cpu(), saved["after"])
    _train(gpu, gpu_optimizer, 1)  # Adam steps on the GPU with what it loaded
    cpu_model, cpu_optimizer = _load(index, "cpu")
    _train(cpu_model, cpu_optimizer, 1)
    for (name, tensor), other in zip(gpu.state_dict().items(), cpu_model.state_dict().values(), strict=True):
        assert torch.allclose(tensor.cpu(), other, rtol=1e-4, atol=1e-5), name


@pytest.mark.cuda
def test_a_gpu_checkpoint_loads_on_cpus_under_two_layouts_and_back_with_the_gpu_rng(tmp_path) -> None:
    run_ranks(2, _gpu_to_cpu_and_back, str(tmp_path), timeout=180, device="cuda")


def _cpu_to_gpu(world, root: str) -> None:
    """A CPU checkpoint (no GPU RNG in it) loads onto the GPU and leaves its generator as seeded."""
    import torch.distributed as dist

    from hpc.checkpoint import Checkpointer, load_rank_state, open_checkpoint
    from hpc.checkpoint.state import state_pieces

    model, optimizer = _model("cpu")
    _train(model, optimizer, 2)
    saver = Checkpointer(root, dist.group.WORLD, async_save=True)
    saver.save(2, state_pieces(model, optimizer), {RNG: torch.get_rng_state()})
    saver.finalize()
    dist.barrier()  # rank 0 has published the step
    index = open_checkpoint(f"{root}/step-00000002")
    gpu, _ = _load(index, "cuda")
    for name, tensor in gpu.state_dict().items():
        assert tensor.is_cuda and torch.equal(tensor.cpu(), model.state_dict()[name]), name
    torch.cuda.manual_seed(5)
    expected = torch.randn(3, device="cuda")
    torch.cuda.manual_seed(5)
    private = load_rank_state(index, world.rank)
    assert CUDA_RNG not in private
    restore_rng(private)
    assert torch.equal(torch.randn(3, device="cuda"), expected)


@pytest.mark.cuda
def test_a_cpu_checkpoint_loads_onto_the_gpu_leaving_its_rng_as_seeded(tmp_path) -> None:
    run_ranks(1, _cpu_to_gpu, str(tmp_path), timeout=120, device="cuda")


def _split_and_whole_on_the_gpu(world, base, save_at: int, total: int) -> None:
    """tests/test_checkpoint_training.py's split and whole runs, on the ranks' shared GPU."""
    from hpc.config import spec_from_dict
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    assert world.device.type == "cuda"
    mesh = build_mesh(resolve_layout("auto", 1, 1, world.size), world.rank, world.device)
    for name, steps, resume in (("split", save_at, "auto"), ("split", total, "auto"), ("whole", total, "never")):
        spec = spec_from_dict({**base, "job": {**base["job"], "name": name}, "train": {**base["train"], "steps": steps},
                               "checkpoint": {**base["checkpoint"], "resume": resume}})
        train(spec, world, mesh)


@pytest.mark.cuda
@pytest.mark.slow
def test_a_gpu_training_run_resumes_exactly_and_its_checkpoint_loads_on_the_cpu(tmp_path) -> None:
    """On the GPU: int8 residuals (restored onto the GPU) and dropout (the GPU's RNG) carry across the resume."""
    from hpc.checkpoint import open_checkpoint, read_tensor
    from hpc.config import spec_from_dict
    from jobs.models.protocol import build_model
    from jobs.train.checkpointing import restore
    from jobs.train.optim import build_optimizer
    from tests.test_checkpoint_training import _assert_resumed_equals_uninterrupted, _base

    base = _base(tmp_path, {"compression": "int8"}, async_save=True)
    run_ranks(2, _split_and_whole_on_the_gpu, base, 10, 20, timeout=240, device="cuda")
    private = _assert_resumed_equals_uninterrupted(tmp_path, 20)
    assert all(CUDA_RNG in private["whole"][rank] for rank in (0, 1))
    assert any(key.startswith("comm/residual/") for key in private["whole"][0])
    step_dir = tmp_path / "whole" / "checkpoints" / "step-00000020"
    spec = spec_from_dict({**base, "job": {**base["job"], "name": "whole"}})
    model = build_model(spec)
    optimizer = build_optimizer(spec.train, model.parameters())
    assert restore(step_dir, 0, model, optimizer) == 20  # in this process, on the CPU
    assert torch.equal(model.state_dict()["0.weight"], read_tensor(open_checkpoint(step_dir), "model/0.weight"))
    assert all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
