"""The placement rule, read from the source: on the training path (hpc/runtime, the health check, parallel/,
the trainer's modules in jobs/), every tensor a torch factory makes names its device (the mesh's, or that of
a tensor it was given), except the host tensors named below, each for its reason. A new CPU allocation on
that path fails here until it names a device or joins the list with a reason."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "randn", "rand", "randint", "as_tensor",
             "linspace", "eye"}
TRAINING_PATH = ["hpc/runtime", "hpc/observe/health.py", "parallel", "parallel/compression", "jobs/train/loop.py",
                 "jobs/train/workloads.py", "jobs/train/parallelize.py", "jobs/models/moe.py", "jobs/models/gpt.py",
                 "jobs/models/hf.py", "jobs/train/optim.py", "jobs/train/checkpointing.py",
                 "jobs/models/materialize.py"]
NOT_TRAINING = {"parallel/plan.py", "parallel/cluster.py"}  # the planner computes with numbers, not tensors
HOST_BY_DESIGN = {  # (file, the call as written) -> why it belongs on the host
    ("hpc/runtime/placement.py", "torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)"):
        "the staging buffer itself",
    ("hpc/runtime/placement.py", "torch.tensor(values, dtype=dtype)"): "host numbers, staged for the device",
    ("hpc/runtime/preemption.py", "torch.tensor([_PRIORITY[self.received] if self.received is not None else 0])"):
        "a flag agreed over the world's Gloo side, before any device work",
    ("jobs/train/workloads.py", "torch.as_tensor(np.asarray(indices, dtype=np.int64))"): "indices into a host data set",
    ("jobs/train/loop.py", "torch.tensor(counted, dtype=torch.int64)"):
        "the count of the host batch's counted targets, agreed over the DP group before forward",
    ("jobs/models/hf.py", "torch.arange(CHECK_TOKENS)"): "the build-time check runs on the host-built model",
    ("parallel/ep.py", "torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))"):
        "a permutation worked out from a few host numbers, moved to the device once",
    ("parallel/ep.py", "torch.zeros(0, dtype=torch.int64)"): "the same permutation, empty",
    ("parallel/optimizer.py", "torch.tensor(self.steps_synchronized)"): "a step counter for the checkpoint",
    ("parallel/large_batch.py", "torch.zeros((), dtype=torch.float32)"): "Adam's step count, on the host as torch's",
    ("parallel/compression/powersgd.py",
     "torch.randn(cols, self.rank, generator=torch.Generator().manual_seed(seed))"):
        "the seeded start drawn on the host (the same on every device), moved once",
}
HOROVOD = ("parallel/horovod.py", "parallel/horovod_coordinator.py")  # size headers and negotiation: host messages


def _unplaced(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    calls = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and not any(keyword.arg == "device" for keyword in node.keywords)):
            calls.append(ast.unparse(node))
    return calls


def _training_files() -> list[Path]:
    files = []
    for entry in TRAINING_PATH:
        path = REPO / entry
        files += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return [f for f in files if str(f.relative_to(REPO)) not in NOT_TRAINING]


def test_the_training_path_allocates_on_a_named_device_or_a_listed_host_tensor() -> None:
    stray = []
    for path in _training_files():
        name = str(path.relative_to(REPO))
        if name in HOROVOD:
            continue
        stray += [f"{name}: {call}" for call in _unplaced(path) if (name, call) not in HOST_BY_DESIGN]
    assert not stray, "host allocations on the training path:\n" + "\n".join(stray)


def test_every_listed_host_tensor_is_still_there() -> None:
    """A list entry whose call is gone is stale: the list says only what is true."""
    found = {(str(p.relative_to(REPO)), call) for p in _training_files() for call in _unplaced(p)}
    assert set(HOST_BY_DESIGN) <= found, sorted(set(HOST_BY_DESIGN) - found)


def test_a_stray_host_allocation_is_caught(tmp_path) -> None:
    module = tmp_path / "stray.py"
    module.write_text("import torch\nx = torch.zeros(3)\ny = torch.zeros(3, device=z.device)\n")
    assert _unplaced(module) == ["torch.zeros(3)"]
