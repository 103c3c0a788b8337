"""Stragglers named (hpc/observe/straggler.py, issue 42): a rank slowed on purpose is named with its host and
slowdown on rank 0's output and in metrics.jsonl; ranks alike are not."""

from __future__ import annotations

import json
import socket
import time

import torch
import torch.distributed as dist

from hpc.config import spec_from_dict
from hpc.observe.report import straggler_rows
from hpc.observe.straggler import Straggler, slow_ranks
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.ranks import run_ranks

SLOW_RANK, SLEEP_S = 1, 0.1


class Classifier(torch.nn.Linear):
    """The digits' linear classifier; its forward sleeps on ``SLOW_RANK`` when ``slow``."""

    def __init__(self, slow: bool) -> None:
        super().__init__(64, 10)
        self.slow = slow

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow and dist.get_rank() == SLOW_RANK:
            time.sleep(SLEEP_S)
        return super().forward(x)

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, targets)


def classifier(slow: bool = False) -> Classifier:
    return Classifier(slow)


def test_a_rank_is_slow_past_the_threshold_over_the_median() -> None:
    assert slow_ranks([1.0, 1.0, 1.0, 2.0], 1.25) == {3: 2.0}
    assert slow_ranks([1.0, 1.2, 1.1], 1.25) == {} and slow_ranks([0.0, 0.0], 1.25) == {}


def _train(world, run_dir: str, slow: bool) -> list[dict]:
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"run_dir": run_dir, "name": f"slow-{slow}", "seed": 1},
        "model": {"entry": "tests.test_straggler:classifier", "args": {"slow": slow}},
        "data": {"name": "digits", "batch_size": 12},
        "train": {"steps": 12, "lr": 0.1, "log_every": 100, "straggler_every": 4, "straggler_threshold": 3.0},
    })
    train(spec, world, build_mesh(MeshShape(world.size, 1, 1), world.rank))
    return [json.loads(line) for line in (spec.run_path / "metrics.jsonl").open()] if world.rank == 0 else []


def test_a_rank_slowed_on_purpose_is_named_with_its_host_and_ranks_alike_are_not(tmp_path) -> None:
    """Rank 1 sleeps 0.1 s in each forward: named after the second comparison running (step 8) and the third (step
    12, the last: in its own record, not lost), in those steps' metrics (rank 0 prints the same line then);
    without the sleep nobody is named."""
    records = run_ranks(3, _train, str(tmp_path), True, backend="gloo")[0]  # the rules' twin below: no naming there
    named = {record["step"]: record["stragglers"] for record in records if "stragglers" in record}
    assert list(named) == [8, 12]
    ((straggler,), (last,)) = named.values()
    assert last["rank"] == SLOW_RANK
    assert (straggler["rank"], straggler["host"]) == (SLOW_RANK, socket.gethostname()) and straggler["slowdown"] > 3
    report = dict(straggler_rows(records))
    assert report["straggler: rank 1"].startswith(f"on {socket.gethostname()}, from step 8, up to ")
    assert Straggler(1, "node7", 4.2).line() == "straggler: rank 1 on node7 computes 4.20x the median rank's step"
    assert not any("stragglers" in record for record in run_ranks(3, _train, str(tmp_path), False, backend="gloo")[0])


def test_the_comparison_keeps_nccl_rules_on_three_ranks(tmp_path) -> None:
    """The comparison's all-gather runs at the same step on every rank, on the main thread, between the step's
    collectives: three ranks train to the end under tests/nccl_rules.py (which raises on a deadlock or on
    collectives met in another order). Under its inline reductions a fast rank's wait for the slow one is not
    told apart from compute on the CPU, so naming is checked over Gloo above."""
    from tests.nccl_rules import BACKEND

    records = run_ranks(3, _train, str(tmp_path), True, backend=BACKEND)[0]
    assert [record["step"] for record in records] == list(range(1, 13))


def test_hpc_status_names_the_stragglers_of_a_job(tmp_path) -> None:
    from slurm.job_registry import JobRecord, failure_lines

    steps = [{"step": 4, "loss": 1.0}, {"step": 8, "stragglers": [{"rank": 2, "host": "node3", "slowdown": 1.6}]},
             {"step": 12, "stragglers": [{"rank": 2, "host": "node3", "slowdown": 2.1}]}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))
    record = JobRecord("41", "slow", 4, str(tmp_path / "slurm"), (str(tmp_path),))
    assert failure_lines([record]) == ["job 41: straggler: rank 2 on node3, from step 8, up to 2.10x the median "
                                       "rank's step"]
