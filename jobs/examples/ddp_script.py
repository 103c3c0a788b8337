"""A plain PyTorch DDP training script, written as the PyTorch DDP tutorial writes one, plus the few
hpc calls (``hpc.session``, ``resume``, ``log``, ``save``, ``preempted``, ``finish``; see hpc/script.py)
that give it checkpoints, metrics and preemption with exact resume under every launcher.

Three ways to run it, unchanged:

    hpc run -n 2 jobs/examples/ddp_script.py --epochs 3                      # local ranks
    hpc run -n 2 --launcher mpirun jobs/examples/ddp_script.py --epochs 3    # or: mpirun -np 2 python ...
    hpc submit jobs/examples/ddp_script.py --ntasks-per-node 2 -- --epochs 3  # Slurm; then hpc status / logs

Its run directory is ``runs/ddp_script`` (under Slurm ``<job.run_dir>/<job.name>``, exported as
``HPC_RUN_PATH``): ``metrics.jsonl``, ``result.json``, ``checkpoints/``. Run it again and it resumes
from the newest checkpoint there. Deterministic by ``--seed``: the data are points labelled by a random
linear teacher, the same on every rank; DistributedSampler deals each rank its share of every epoch.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hpc

FEATURES, CLASSES = 32, 10


class ToyModel(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.net1 = nn.Linear(FEATURES, hidden)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def synthetic_data(seed: int, samples: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, test): points labelled by a random linear teacher, drawn from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples + 1024, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(dim=1)
    return TensorDataset(x[:samples], y[:samples]), TensorDataset(x[samples:], y[samples:])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="DDP on synthetic data, with hpc checkpoints and metrics")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=4096, help="training points")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    return parser.parse_args()


def global_mean(value: torch.Tensor, size: int) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)  # the sum over ranks
    return total.item() / size


def main() -> None:
    args = parse_args()
    with hpc.session() as run:  # hpc.init(), plus Slurm's warning signals handled and a run directory
        torch.manual_seed(args.seed)
        train_set, test_set = synthetic_data(args.seed, args.samples)
        sampler = DistributedSampler(train_set, num_replicas=run.size, rank=run.rank, seed=args.seed, drop_last=True)
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True)
        model = DDP(ToyModel(args.hidden).to(run.device),
                    device_ids=[run.device.index] if run.device.type == "cuda" else None)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loss_fn = nn.CrossEntropyLoss()

        step = run.resume(model, optimizer)  # the newest checkpoint's step, or 0
        per_epoch, mean_loss = len(loader), float("nan")
        for epoch in range(step // per_epoch, args.epochs):
            sampler.set_epoch(epoch)
            for x, y in itertools.islice(loader, step - epoch * per_epoch, None):  # resumed mid-epoch: skip ahead
                optimizer.zero_grad()
                loss = loss_fn(model(x.to(run.device)), y.to(run.device))
                loss.backward()
                optimizer.step()
                step += 1
                mean_loss = global_mean(loss, run.size)
                run.log(step, loss=mean_loss, epoch=epoch)
                if step % args.checkpoint_every == 0:
                    run.save(step)
                if run.preempted(step):  # every rank, same step, checkpointed: leave; the job requeues
                    return
        run.save(step)
        with torch.no_grad():
            x, y = test_set.tensors
            accuracy = (model(x.to(run.device)).argmax(dim=1).cpu() == y).float().mean().item()
        run.finish(test_accuracy=accuracy)
        if run.rank == 0:
            ranks = f"{run.size} rank{'s' * (run.size > 1)}"
            print(f"summary: {step} steps | final loss {mean_loss:.4f} | test accuracy {accuracy:.1%} | "
                  f"{ranks} via {run.world.info.launcher.value} | run {run.run_path}", flush=True)


if __name__ == "__main__":
    main()
