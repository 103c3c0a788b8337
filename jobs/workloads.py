"""What the training loop needs from each kind of model, whatever the (dp, tp, pp) layout.

A workload builds the full single-device model from the seed, then keeps this rank's
share of it: tensor-parallel layers on the TP group, then the pipeline stages of this
PP rank. Layers that other pipeline ranks hold are replaced by ``Elsewhere``
placeholders, so the parameters a rank keeps have their single-device names, and
checkpoints and comparisons speak of the same tensors under every layout. It also
draws this data-parallel replica's batch, a pure function of (seed, step), and
evaluates the model at the end of a run.

- ``DigitsMLP``: the classifier on scikit-learn's digits, data-parallel only.
- ``LicensesGPT``: the byte-level GPT on the license texts, under any layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hpc.config import JobSpec
from hpc.errors import LayoutError
from hpc.runtime.mesh import Mesh
from jobs.datasets import (
    Dataset,
    byte_windows,
    dp_shard,
    global_batch_indices,
    held_out_starts,
    load_digits,
    load_licenses,
    window_starts,
)
from jobs.gpt import GPT, Block, build_gpt, lm_loss
from jobs.models import MLP
from jobs.parallelize import parallelize_tp
from parallel.pipeline import split_into_stages

EVAL_WINDOWS = 256  # held-out windows the GPT is evaluated on, spread over the whole held-out text


class Stage(nn.Module):
    """One pipeline chunk as the executor calls it: its layers in order, under the run's autocast,
    transformer blocks optionally recomputed in backward instead of keeping their activations."""

    def __init__(self, layers: Sequence[nn.Module], bf16_autocast: bool, recompute_blocks: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.bf16_autocast, self.recompute_blocks = bf16_autocast, recompute_blocks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast):
            for layer in self.layers:
                if self.recompute_blocks and isinstance(layer, Block):
                    x = checkpoint(layer, x, use_reentrant=False)
                else:
                    x = layer(x)
        return x


class Elsewhere(nn.Module):
    """Stands in for a layer another pipeline rank holds, keeping the names of the layers this rank holds."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise LayoutError(f"{self.name} is held by another pipeline rank; run this rank's stages instead")


class Workload(ABC):
    """This rank's share of a model kind and its data; see the module docstring."""

    model: nn.Module  # this rank's share, with the single-device parameter names
    chunks: list[Stage]  # this rank's pipeline chunks in stage order; one holding the whole model if not cut
    unit: str  # what throughput counts
    items_per_sample: int

    def __init__(self, spec: JobSpec, mesh: Mesh) -> None:
        self.spec, self.mesh = spec, mesh

    @abstractmethod
    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel replica's (inputs, targets) at ``step``, identical on its TP and PP ranks."""

    @abstractmethod
    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a (micro)batch from the last stage's output."""

    @abstractmethod
    def evaluate(self) -> dict[str, float]:
        """End-of-run measures, the same on every rank (collective)."""

    def activation_shape(self, rows: int) -> tuple[int, ...]:
        """What crosses a pipeline stage boundary for a microbatch of ``rows`` samples."""
        raise LayoutError(f"model.kind={self.spec.model.kind!r} cannot be cut into pipeline stages")


def build_mlp(spec: JobSpec, dataset: Dataset) -> MLP:
    torch.manual_seed(spec.job.seed)
    return MLP(dataset.num_features, spec.model.hidden_sizes, dataset.num_classes, spec.model.dropout)


class DigitsMLP(Workload):
    unit, items_per_sample = "samples", 1

    def __init__(self, spec: JobSpec, mesh: Mesh) -> None:
        super().__init__(spec, mesh)
        self.dataset = load_digits()
        self.model = build_mlp(spec, self.dataset)
        self.chunks = [Stage([self.model], spec.train.bf16_autocast, recompute_blocks=False)]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        indices = global_batch_indices(len(self.dataset.y_train), self.spec.data.batch_size, self.spec.job.seed, step)
        local = torch.from_numpy(dp_shard(indices, self.mesh.index("dp"), self.mesh.size("dp")))
        return self.dataset.x_train[local], self.dataset.y_train[local]

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float(), targets)

    def evaluate(self) -> dict[str, float]:
        """Loss on the whole training set (less noisy than one batch's) and accuracy on the test set."""
        data = self.dataset
        self.model.eval()
        with torch.no_grad():
            train_loss = F.cross_entropy(self.model(data.x_train), data.y_train).item()
            predicted = self.model(data.x_test).argmax(dim=1)
        self.model.train()
        return {"train_loss": train_loss, "test_accuracy": (predicted == data.y_test).float().mean().item()}


def keep_stages(model: GPT, p: int, rank: int, v: int, bf16_autocast: bool, recompute_blocks: bool) -> list[Stage]:
    """Cut the blocks into p*v stages (the embedding joins the first, the head the last) and keep
    pipeline rank ``rank``'s v chunks, replacing every layer it does not hold by ``Elsewhere``."""
    last = p * v - 1
    chunks = []
    for k, blocks in enumerate(split_into_stages(list(model.blocks), p, v)[rank]):
        stage = k * p + rank
        layers = [*([model.embedding] if stage == 0 else []), *blocks, *([model.head] if stage == last else [])]
        chunks.append(Stage(layers, bf16_autocast, recompute_blocks))
    held = {id(layer) for chunk in chunks for layer in chunk.layers}
    for index, block in enumerate(model.blocks):
        if id(block) not in held:
            model.blocks[index] = Elsewhere(f"blocks.{index}")
    for name in ("embedding", "head"):
        if id(getattr(model, name)) not in held:
            setattr(model, name, Elsewhere(name))
    return chunks


class LicensesGPT(Workload):
    unit = "tokens"

    def __init__(self, spec: JobSpec, mesh: Mesh) -> None:
        super().__init__(spec, mesh)
        self.corpus = load_licenses()
        self.items_per_sample = spec.model.seq_len
        torch.manual_seed(spec.job.seed)  # dropout: TP ranks must drop the same units of their replicated activations
        self.model = build_gpt(spec.model, spec.job.seed)
        self.tp_group = mesh.group("tp") if mesh.size("tp") > 1 else None
        if self.tp_group is not None:
            parallelize_tp(self.model, self.tp_group)
        par = spec.parallel
        self.chunks = keep_stages(self.model, mesh.size("pp"), mesh.index("pp"), par.virtual_stages,
                                  spec.train.bf16_autocast, spec.train.activation_checkpointing)

    def activation_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.spec.model.seq_len, self.spec.model.d_model)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.spec
        starts = window_starts(len(self.corpus.train), cfg.data.batch_size, cfg.model.seq_len, cfg.job.seed, step)
        local = dp_shard(starts, self.mesh.index("dp"), self.mesh.size("dp"))
        return byte_windows(self.corpus.train, local, cfg.model.seq_len)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(output.float(), targets, self.tp_group)

    def evaluate(self) -> dict[str, float]:
        """Mean next-byte loss on ``EVAL_WINDOWS`` held-out windows, split over the DP replicas."""
        seq_len = self.spec.model.seq_len
        starts = held_out_starts(len(self.corpus.test), seq_len)
        starts = starts[np.linspace(0, len(starts) - 1, min(EVAL_WINDOWS, len(starts))).astype(int)]
        local = np.array_split(starts, self.mesh.size("dp"))[self.mesh.index("dp")]
        loss_sum = 0.0
        if len(local):  # the same on every TP and PP rank of this replica, so their collectives match
            inputs, targets = byte_windows(self.corpus.test, local, seq_len)
            self.model.eval()
            with torch.no_grad():
                logits = forward_through_stages(self.chunks, self.mesh.group("pp"), inputs,
                                                self.activation_shape(len(local)))
                if logits is not None:
                    loss_sum = self.loss(logits, targets).item() * len(local)
            self.model.train()
        total, count = sum_over_replicas([loss_sum, float(len(local))], self.mesh)
        return {"held_out_loss": total / count}


def forward_through_stages(
    chunks: Sequence[nn.Module], group: dist.ProcessGroup, inputs: torch.Tensor, activation_shape: Sequence[int]
) -> torch.Tensor | None:
    """Forward only, stage after stage (no microbatches, no backward): the last stage's output on
    the rank that holds it, None elsewhere. For evaluation, where a schedule would buy nothing."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    last = p * len(chunks) - 1
    x = inputs
    for stage in range(rank, last + 1, p):
        if stage > 0 and p > 1:
            x = torch.empty(tuple(activation_shape))
            dist.recv(x, group=group, group_src=(stage - 1) % p)
        x = chunks[stage // p](x)
        if stage < last and p > 1:
            dist.send(x.contiguous(), group=group, group_dst=(stage + 1) % p)
    return x if rank == last % p else None


def sum_over_replicas(values: Sequence[float], mesh: Mesh) -> list[float]:
    """Sums over the DP replicas of numbers held by the last pipeline stage, on every rank.

    One all-reduce over the whole mesh in float64, to which only the ranks of the last
    stage with TP index 0 contribute (their TP peers hold the same numbers).
    """
    reports = mesh.index("pp") == mesh.size("pp") - 1 and mesh.index("tp") == 0
    totals = torch.tensor(values if reports else [0.0] * len(values), dtype=torch.float64)
    dist.all_reduce(totals)
    return totals.tolist()


WORKLOADS: dict[str, Callable[[JobSpec, Mesh], Workload]] = {"mlp": DigitsMLP, "gpt": LicensesGPT}


def build_workload(spec: JobSpec, mesh: Mesh) -> Workload:
    return WORKLOADS[spec.model.kind](spec, mesh)
