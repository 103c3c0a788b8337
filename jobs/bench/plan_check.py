"""Measure layouts of a job spec for ``hpc plan --validate``: each runs briefly under ``hpc run`` in a scratch run
directory; its step time is rank 0's median over the steps after the warm-up, its peak memory the largest peak
resident set of any rank (runs/<name>/ranks/rank-*.json); every case once per round, and each row set against the
planner's prediction (parallel/calibrate.py). Standard library only: the ranks import torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from hpc.errors import HpcError, RankFailedError
from jobs.bench.rank import rank_command
from parallel.cluster import Cluster

RING_SIZES = "4K,64K,1M,4M,16M"  # the all-reduce messages a link's alpha and beta are fitted to


@dataclass(frozen=True)
class Case:
    """One layout to run: a label, the ranks, the spec overrides (KEY=VALUE) that make it, and on the testbed the
    ranks of each virtual host (a node)."""

    label: str
    nprocs: int
    overrides: tuple[str, ...]
    ranks_per_host: int = 1


def _dp(codec: str = "none", zero: int = 0) -> tuple[str, ...]:
    return ("parallel.tp=1", "parallel.pp=1", "parallel.microbatches=1", f"parallel.compression={codec}",
            f"parallel.zero={zero}")


def _pp(schedule: str, tp: int = 1, virtual: int = 1) -> tuple[str, ...]:
    return (f"parallel.tp={tp}", "parallel.pp=2", "parallel.microbatches=4", f"parallel.schedule={schedule}",
            f"parallel.virtual_stages={virtual}")


# The layouts issue 19 asks for, of jobs/examples/gpt.toml (4 layers, 4 heads): DP with and without a codec and
# with each ZeRO stage, TP, PP with each schedule, and one rank; two of four ranks on the two cores.
CASES = (
    Case("one rank", 1, _dp()),
    Case("one rank ckpt", 1, (*_dp(), "train.activation_checkpointing=true")),
    Case("one rank sac", 1, (*_dp(), "train.activation_checkpointing=true", "train.recompute=selective")),
    Case("dp=2", 2, _dp()),
    Case("dp=2 fp16", 2, _dp("fp16")),
    Case("dp=2 zero=1", 2, _dp(zero=1)),
    Case("dp=2 zero=2", 2, _dp(zero=2)),
    Case("dp=2 zero=3", 2, _dp(zero=3)),
    Case("tp=2", 2, ("parallel.tp=2", "parallel.pp=1", "parallel.microbatches=1")),
    Case("pp=2 gpipe", 2, _pp("gpipe")),
    Case("pp=2 1f1b", 2, _pp("1f1b")),
    Case("pp=2 interleaved", 2, _pp("interleaved", virtual=2)),
    Case("dp=4", 4, _dp()),
    Case("tp=2 pp=2 1f1b", 4, _pp("1f1b", tp=2)),
)
# Issue 41's exchange cut by node, on the testbed only (its hosts are the nodes): 2 nodes of 2 ranks, flat and cut,
# uncompressed and int8; --layouts names them.
NODE_CASES = tuple(
    Case(f"2x2 dp=4{' ' + codec if codec != 'none' else ''}{' cut' if scope == 'inter-node' else ''}", 4,
         (*_dp(codec), f"parallel.compression_scope={scope}"), ranks_per_host=2)
    for codec in ("none", "int8") for scope in ("flat", "inter-node"))


def select(labels: list[str] | None) -> tuple[Case, ...]:
    """The named cases (all when ``labels`` is empty); an unknown label raises KeyError naming the known ones."""
    if not labels:
        return CASES
    known = {case.label: case for case in (*CASES, *NODE_CASES)}
    missing = [label for label in labels if label not in known]
    if missing:
        raise KeyError(f"no layout {missing[0]!r}; known: {', '.join(known)}")
    return tuple(known[label] for label in labels)


def _sets(case: Case, extra: list[str], steps: int, scratch: str) -> list[str]:
    sets = [*extra, *case.overrides, f"job.run_dir={scratch}", "job.name=check", f"train.steps={steps}",
            f"train.log_every={steps}", "checkpoint.every_steps=0"]
    return [arg for item in sets for arg in ("--set", item)]


def _measured(case: Case, extra: list[str], run: Path, warmup: int) -> dict:
    steps_s = [json.loads(line)["step_time_s"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    peaks = [json.loads(path.read_text())["peak_memory_bytes"] for path in sorted(run.glob("ranks/rank-*.json"))]
    kept = sorted(steps_s[warmup:])
    return {"label": case.label, "nprocs": case.nprocs, "overrides": [*extra, *case.overrides],
            "step_s": kept[len(kept) // 2], "steps_s": steps_s, "peak_bytes": max(peaks), "peaks_bytes": peaks}


def merge_repeats(runs: list[dict]) -> dict:
    """One row from repeated runs of a case: the median of the runs' median step times (a run whose steps a busy
    machine stretched moves it least), the largest peak memory, and every run's own figures."""
    medians = sorted(run["step_s"] for run in runs)
    return {**runs[0], "step_s": medians[len(medians) // 2], "runs_step_s": [run["step_s"] for run in runs],
            "steps_s": [run["steps_s"] for run in runs], "peak_bytes": max(run["peak_bytes"] for run in runs),
            "peaks_bytes": [run["peaks_bytes"] for run in runs]}


def run_case(spec: str, case: Case, extra: list[str], steps: int, warmup: int, launcher: str | None = None) -> dict:
    """Run ``case`` for ``steps`` steps; the median step time after ``warmup`` steps and the peak memory."""
    with tempfile.TemporaryDirectory(prefix="hpc-plan-check-") as scratch:
        argv = [sys.executable, "-m", "hpc.cli.main", "run", "-n", str(case.nprocs), spec]
        argv += ["--launcher", launcher] if launcher else []
        done = subprocess.run([*argv, *_sets(case, extra, steps, scratch)], capture_output=True, text=True)
        if done.returncode:
            raise RankFailedError(f"{case.label}: hpc run exited {done.returncode}: {done.stderr.strip()[-800:]}")
        return _measured(case, extra, Path(scratch) / "check", warmup)


class Testbed:
    """The namespace testbed (slurm/testbed/netns.py) with ``nprocs`` virtual hosts, links shaped to ``rate``; ranks
    start one per host, torchrun-style as slurm/testbed/bench.sh starts them, one thread each. A context manager:
    the namespaces are removed after, also on failure. Needs root."""

    def __init__(self, hosts: int, rate: str = "1gbit", prefix: str = "hpcplan", subnet: str = "10.77.3",
                 nics: int = 1) -> None:
        self.hosts, self.rate, self.subnet, self.nics = hosts, rate, subnet, nics
        self.netns = [sys.executable, "-m", "slurm.testbed.netns", "--prefix", prefix]

    def __enter__(self) -> Testbed:
        made = subprocess.run([*self.netns, "create", str(self.hosts), "--rate", self.rate, "--subnet", self.subnet,
                               "--nics", str(self.nics)], capture_output=True, text=True)
        if made.returncode:
            said = made.stderr.strip().splitlines() or [f"exit {made.returncode}"]
            raise HpcError(f"--testbed: the namespace testbed could not be made: {said[-1]}")
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([*self.netns, "destroy"], capture_output=True)

    def run(self, what: str, *argv: str, n: int | None = None, per_host: int = 1) -> None:
        """``python *argv`` as n ranks (default a rank on every host) at once, ``per_host`` on each of the first
        hosts, rank j of a host on its NIC j, as slurm/testbed/bench.sh starts them; raises naming ``what`` with
        the failed ranks' last words."""
        n = n or self.hosts
        self._wait(what, [self._start(argv, divmod(rank, per_host), rank, n, per_host, f"{self.subnet}.1")
                          for rank in range(n)])

    def run_on_every_host(self, what: str, argv_of_host: Callable[[int], tuple[str, ...]], per_host: int) -> None:
        """A job of ``per_host`` ranks on each host at once, its own (it meets at the host's own address, over the
        loopback): one node's stage of the exchange cut by node with every node's ranks busy, as in a run."""
        self._wait(what, [self._start(argv_of_host(host), (host, local), local, per_host, per_host,
                                      f"{self.subnet}.{host + 1}")
                          for host in range(self.hosts) for local in range(per_host)])

    def _start(self, argv: tuple[str, ...], where: tuple[int, int], rank: int, n: int, per_host: int,
               master: str) -> subprocess.Popen:
        host, local = where
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(n), "LOCAL_RANK": str(local),
               "LOCAL_WORLD_SIZE": str(per_host), "GROUP_RANK": str(rank // per_host),
               "GROUP_WORLD_SIZE": str(n // per_host), "MASTER_ADDR": master, "MASTER_PORT": "29517",
               "OMP_NUM_THREADS": "1"}
        return subprocess.Popen([*self.netns, "exec", "--nic", str(local), str(host), "--", sys.executable, *argv],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @staticmethod
    def _wait(what: str, ranks: list[subprocess.Popen]) -> None:
        failed = [(proc.wait(), proc.stderr.read()) for proc in ranks]
        if any(code for code, _ in failed):
            raise RankFailedError(f"{what} on the testbed: {[err[-400:] for _, err in failed]}")

    def ring_rows(self, sizes: str, inside: int = 0) -> list[dict]:
        """``hpc bench allreduce``'s rows of our ring (torch transport, no codec) across the testbed's links, a rank
        a host; with ``inside``, the rows of a node's stages of the exchange cut by node (impl ``cut``: the
        reduce-scatter and all-gather through the node's shared memory, as a run's go) among that many ranks of
        each host at once, each host one node (the first host's rows: the node's stages as its ranks see them when
        every node's ranks run)."""
        options = ("--sizes", sizes, "--codecs", "none", "--transports", "torch", "--iters", "5")
        with tempfile.TemporaryDirectory(prefix="hpc-plan-link-") as scratch:
            out = os.path.join(scratch, "rows-{}.json")
            if inside:
                self.run_on_every_host("the node stages' bench", lambda host: rank_command(
                    "allreduce", out.format(host), *options, "--scopes", "inter-node"), per_host=inside)
            else:
                self.run("the all-reduce bench", *rank_command("allreduce", out.format(0), *options))
            with open(out.format(0)) as handle:
                return json.load(handle)

    def run_case(self, spec: str, case: Case, extra: list[str], steps: int, warmup: int) -> dict:
        """``case``, ``case.ranks_per_host`` ranks a host, measured like :func:`run_case`."""
        with tempfile.TemporaryDirectory(prefix="hpc-plan-check-") as scratch:
            self.run(case.label, "-m", "hpc.cli.rank", spec, *_sets(case, extra, steps, scratch), n=case.nprocs,
                     per_host=case.ranks_per_host)
            return {**_measured(case, extra, Path(scratch) / "check", warmup), "ranks_per_host": case.ranks_per_host}


def validate(
    spec: str, cases: tuple[Case, ...], cluster: Cluster, extra: list[str], steps: int, warmup: int, repeats: int,
    launcher: str | None = None, testbed: str | None = None,
) -> tuple[Cluster, list[dict], list[float]]:
    """Run each case ``repeats`` times, locally or on the namespace testbed with links shaped to ``testbed``: (the
    cluster the predictions use, the measured rows with the predictions next to them, the 1-minute load average
    before and after each run)."""
    load = [os.getloadavg()[0]]
    if testbed:
        from parallel.calibrate import ring_link, testbed_cluster

        per_host = max(case.ranks_per_host for case in cases)
        with Testbed(max(case.nprocs // case.ranks_per_host for case in cases), testbed, nics=per_host) as bed:
            # the link as measured across the testbed and a node's stages on a host, each the median of ``repeats`` fits
            link = median_fit([ring_link(bed.ring_rows(RING_SIZES)) for _ in range(repeats)])
            inside = median_fit([ring_link(bed.ring_rows(RING_SIZES, inside=per_host), impl="cut")
                                 for _ in range(repeats)]) if per_host > 1 else None
            measured = in_rounds(repeats, cases, load, lambda case: bed.run_case(spec, case, extra, steps, warmup))
        cluster = testbed_cluster(cluster, testbed, link)
        if inside:  # a node's stages on a host, as measured there (the rows of nodes of several ranks use them)
            cluster = replace(cluster, intra_alpha_us=inside[0] * 1e6, intra_gbps=inside[1] / 1e9)
    else:
        measured = in_rounds(repeats, cases, load, lambda case: run_case(spec, case, extra, steps, warmup, launcher))
    return cluster, compare(spec, measured, cluster), load


def median_fit(fits: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha, beta) each the median of its fits: one fit of a shaped link or a busy loopback moves either by 2x."""
    alphas, betas = sorted(alpha for alpha, _ in fits), sorted(beta for _, beta in fits)
    return alphas[len(fits) // 2], betas[len(fits) // 2]


def in_rounds(repeats: int, cases: tuple[Case, ...], load: list[float], measure: Callable[[Case], dict]) -> list[dict]:
    """Every case once per round, ``repeats`` rounds (a slow minute of the machine then touches one run of each
    case, not every run of one), merged per case; the load average after each run is appended to ``load``."""
    runs: list[list[dict]] = [[] for _ in cases]
    for _ in range(repeats):
        for index, case in enumerate(cases):
            runs[index].append(measure(case))
            load.append(os.getloadavg()[0])
    return [merge_repeats(case_runs) for case_runs in runs]


def compare(spec_path: str, rows: list[dict], cluster: Cluster) -> list[dict]:
    """Each measured row with the planner's prediction of its spec and ranks next to it, and their ratios
    (predicted over measured)."""
    from hpc.config import load_spec
    from jobs.models.shape import spec_model
    from parallel.calibrate import compared, predict

    out = []
    for row in rows:
        spec = load_spec(spec_path, row["overrides"])
        node = replace(cluster, devices_per_node=row.get("ranks_per_host", cluster.devices_per_node))
        out.append(compared(row, predict(spec, spec_model(spec), row["nprocs"], node)))
    return out
