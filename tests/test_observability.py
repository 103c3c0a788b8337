"""Metrics, timeline, health check and stall inspector: what a run writes and how a stalled job ends."""

from __future__ import annotations

import datetime
import json
import re
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from hpc.config import spec_from_dict
from hpc.observe.metrics import FIELDS
from hpc.observe.stall import StallWatch
from tests.ranks import run_ranks

REPO = Path(__file__).resolve().parent.parent


def _observed_run(world, run_dir: str):
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"name": "observed", "run_dir": run_dir},
        "model": {"kind": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": 3, "timeline": True, "health_check": True, "log_every": 1},
        "parallel": {"dp": 2, "pp": 2, "microbatches": 2, "compression": "int8"},
    })
    mesh = build_mesh(resolve_layout(2, 1, 2, world.size), world.rank)
    train(spec, world, mesh)
    return str(spec.run_path)


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory) -> Path:
    """A 4-rank GPT run (dp=2 x pp=2, int8) with the timeline and the health check on."""
    run_dir = tmp_path_factory.mktemp("runs")
    return Path(run_ranks(4, _observed_run, str(run_dir), timeout=240)[0])


def documented_fields() -> list[str]:
    text = (REPO / "docs" / "OBSERVABILITY.md").read_text()
    return re.findall(r"^\| `(\w+)` \|", text, flags=re.MULTILINE)


def test_the_documented_fields_are_the_schema() -> None:
    assert documented_fields() == list(FIELDS)


def test_metrics_file_has_every_documented_field(observed_run: Path) -> None:
    records = [json.loads(line) for line in (observed_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    expected = set(FIELDS) - {"samples_per_s"}  # the GPT counts tokens
    for record in records:
        assert expected <= set(record), expected - set(record)
        assert record["wait_s"] <= record["step_time_s"]
        assert record["compute_s"] == pytest.approx(record["step_time_s"] - record["wait_s"])
        assert record["comm_bytes"] > 0 and record["peak_memory_bytes"] > 0
        assert record["grad_norm"] > 0
    # int8 after no warm-up: about a quarter of the bytes of an uncompressed ring
    assert 2.5 < records[-1]["compression_ratio"] < 4.5


def test_peak_memory_is_the_ranks_own_not_its_large_parents() -> None:
    """ru_maxrss survives fork and exec: a rank started by a 400 MB process would report 400 MB."""
    import sys

    parent = bytearray(400 << 20)
    parent[::4096] = b"\x01" * len(parent[::4096])  # resident
    probe = "from hpc.observe.metrics import peak_memory_bytes; print(peak_memory_bytes())"
    child = int(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout)
    assert 1 << 20 < child < 200 << 20
    del parent


def test_tensorboard_gets_the_same_scalars(observed_run: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(observed_run / "tensorboard"))
    events.Reload()
    records = [json.loads(line) for line in (observed_run / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r["loss"] for r in records])
    assert "tokens_per_s" in events.Tags()["scalars"]


def test_every_rank_writes_its_time_totals(observed_run: Path) -> None:
    for rank in range(4):
        totals = json.loads((observed_run / "ranks" / f"rank-{rank:05d}.json").read_text())
        assert totals["rank"] == rank and totals["steps"] == 3
        assert totals["compute_s"] + totals["wait_s"] == pytest.approx(totals["step_time_s"])


def test_timeline_is_chrome_trace_with_spans_from_every_rank(observed_run: Path) -> None:
    trace = json.loads((observed_run / "timeline.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    for event in spans:
        assert {"name", "cat", "ts", "dur", "pid", "tid"} <= set(event) and event["dur"] >= 0
    names = {(e["pid"], e["name"]) for e in spans}
    for rank in range(4):
        assert {(rank, "forward"), (rank, "backward"), (rank, "optimizer step"), (rank, "allreduce bucket0")} <= names
    reductions = [e for e in spans if e["name"].startswith("allreduce")]
    assert {e["args"]["codec"] for e in reductions} == {"none", "int8"} or {e["args"]["codec"] for e in reductions} == {
        "int8"}
    stage0_sends = [e for e in trace["traceEvents"] if e["pid"] in (0, 1) and e["name"].startswith("send F")]
    stage1_receives = [e for e in spans if e["pid"] in (2, 3) and e["name"].startswith("recv F")]
    assert len(stage0_sends) == len(stage1_receives) == 2 * 2 * 3  # 2 ranks x 2 microbatches x 3 steps
    process_names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(process_names) == [0, 1, 2, 3] and process_names[3].startswith("rank 3 (")


def test_health_check_reports_the_slowest_link() -> None:
    reports = run_ranks(4, _health, timeout=120)
    report = reports[0]
    assert set(report.allreduce_s) == {"world", "tp", "dp"}
    links = {(link.axis, link.src, link.dst) for link in report.links}
    assert links == {("world", (r - 1) % 4, r) for r in range(4)} | {("tp", 1, 0), ("tp", 0, 1), ("tp", 3, 2),
                                                                     ("tp", 2, 3), ("dp", 2, 0), ("dp", 0, 2),
                                                                     ("dp", 3, 1), ("dp", 1, 3)}
    slowest = report.slowest()
    assert slowest.seconds == max(link.seconds for link in report.links)
    assert f"rank {slowest.src} -> {slowest.dst}" in report.lines()[-1]
    assert all(r.links == report.links for r in reports)  # gathered: every rank holds the same report


def _health(world):
    from hpc.observe.health import check_mesh
    from hpc.observe.probe import Probe
    from hpc.runtime.mesh import build_mesh, resolve_layout

    return check_mesh(build_mesh(resolve_layout(2, 2, 1, 4), world.rank), Probe(), timeout_s=30, message_bytes=1 << 16)


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.aborted: list[str] = []


def _watches(recorder: _Recorder, warn_s: float, abort_s: float) -> tuple[StallWatch, StallWatch, object]:
    import torch.distributed as dist

    from hpc.runtime.bootstrap import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=5))
    watch = StallWatch(server, 0, warn_s, abort_s, interval_s=0.05, log=recorder.lines.append,
                       on_abort=recorder.aborted.append)
    peer = StallWatch(client, 1, warn_s, abort_s, interval_s=0.05, log=recorder.lines.append,
                      on_abort=recorder.aborted.append)
    return watch, peer, server


def test_stall_names_the_missing_rank_and_what_it_does_then_aborts() -> None:
    recorder = _Recorder()
    watch, peer, _server = _watches(recorder, warn_s=0.3, abort_s=0.9)
    with watch, peer:
        watch.step = peer.step = 7
        peer.doing("data")
        with peer.waiting("allreduce bucket0", "grad-reduce", [0, 1]):
            pass  # the peer finished the step before: its count on grad-reduce is 1
        with watch.waiting("allreduce bucket0", "grad-reduce", [0, 1]):
            pass
        with watch.waiting("allreduce bucket0", "grad-reduce", [0, 1]):  # the second one: the peer is late
            deadline = time.monotonic() + 5
            while not recorder.aborted and time.monotonic() < deadline:
                time.sleep(0.02)
    warning = next(line for line in recorder.lines if line.startswith("hpc: stall:"))
    assert "rank 0" in warning and "allreduce bucket0 (#2 on channel grad-reduce) at step 7" in warning
    assert re.search(r"not arrived: rank 1 \([^)]*step 7, in data for \d+ s\)", warning), warning
    assert len(recorder.aborted) == 1 and "not arrived: rank 1" in recorder.aborted[0]
    assert any(line.startswith("hpc: error:") and "aborting" in line for line in recorder.lines)


def test_stall_when_every_peer_arrived_blames_the_link() -> None:
    recorder = _Recorder()
    watch, peer, _server = _watches(recorder, warn_s=0.2, abort_s=30)
    with watch, peer:
        with peer.waiting("recv F mb0 stage1", "p2p:0>1", [0]):
            with watch.waiting("recv F mb0 stage1", "p2p:0>1", [1]):
                deadline = time.monotonic() + 5
                while len(recorder.lines) < 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
    assert any(line.startswith("hpc: stall: rank 0") and "every peer (1) entered it" in line
               for line in recorder.lines), recorder.lines
    assert not recorder.aborted


STALLED_JOB = """\
import sys, time
import torch.distributed as dist
import jobs.train.workloads
from hpc.cli.rank import main

batch = jobs.train.workloads.Workload.host_batch  # what the training loop draws each step's batch with

def late_batch(self, step):  # rank 3 goes missing at step 3, long past every threshold
    if step == 3 and dist.get_rank() == 3:
        time.sleep(600)
    return batch(self, step)

jobs.train.workloads.Workload.host_batch = late_batch
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_late_rank_is_named_and_the_job_aborts_in_time(tmp_path: Path) -> None:
    script = tmp_path / "stalled.py"
    script.write_text(STALLED_JOB)
    spec = tmp_path / "job.toml"
    spec.write_text(textwrap.dedent(f"""\
        [job]
        name = "stalled"
        run_dir = "{tmp_path}"
        [train]
        steps = 10
        stall_warn_s = 3
        stall_abort_s = 8
    """))
    started = time.monotonic()
    done = subprocess.run(["hpc", "run", "-n", "4", "--launcher", "local",
                           str(script), str(spec)], capture_output=True, text=True, timeout=200, cwd=REPO)
    elapsed = time.monotonic() - started
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    warnings = [line for line in output.splitlines() if "hpc: stall:" in line]
    assert warnings, output
    # step 4's batch is read during step 3, after its optimizer step (queued behind the step's work on a
    # GPU): the others wait in step 3's loss all-reduce (the digits set marks no target, so no count of
    # counted targets is agreed first)
    assert re.search(r"in loss all-reduce .* at step 3; not arrived: rank 3 \([^)]*step 3, in data for",
                     warnings[0]), warnings[0]
    assert re.search(r"rank [012] .*aborting the job \(stall abort threshold 8 s\)", output), output
    assert "aborted by the stall inspector" in output  # the launcher's line naming the rank that exited first
    # far sooner than the late rank's sleep (600 s) or the backend's timeout (parallel.timeout_s = 300 s)
    assert elapsed < 120, elapsed


def test_stall_report_survives_a_dead_store() -> None:
    """The store lives on rank 0: when rank 0 is gone the others must still report and abort."""
    import datetime

    import torch.distributed as dist

    from hpc.runtime.bootstrap import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=5))
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=2))
    recorder = _Recorder()
    watch = StallWatch(client, 1, 0.2, 0.6, interval_s=0.05, log=recorder.lines.append,
                       on_abort=recorder.aborted.append)
    del server  # rank 0 died: its store went with it
    started = time.monotonic()
    with watch, watch.waiting("allreduce bucket0", "grad-reduce", [0, 1, 2]):
        while not recorder.aborted and time.monotonic() - started < 10:
            time.sleep(0.02)
    assert recorder.aborted, recorder.lines
    assert "rank 0 (no report" in recorder.aborted[0] and "rank 2 (no report" in recorder.aborted[0]
    assert "[store:" in recorder.aborted[0]
    assert time.monotonic() - started < 5  # one failed query per report, not one timeout per peer


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


class _Group:  # a process group's stand-in: what the registry keys (weakly) by
    pass


def test_a_wait_for_the_device_names_who_never_issued_a_groups_last_collective() -> None:
    """On a GPU the hosts only queue collectives and then wait for the step's event: rank 1 skipped one TP
    all-reduce, so both wait for the device, and both reports name the all-reduce rank 1 never issued."""
    from hpc.observe.probe import Probe, group_collective

    recorder = _Recorder()
    watch, peer, _server = _watches(recorder, warn_s=0.3, abort_s=0.9)
    groups = {0: _Group(), 1: _Group()}  # stand-ins for each rank's handle on the TP group
    tp = Probe(stall=watch), Probe(stall=peer)
    with tp[0], tp[1]:
        for rank, probe in enumerate(tp):
            probe.set_step(2)
            probe.watch_group("tp", groups[rank], [0, 1])
            for _ in range(3 - rank):  # queued: each returns at once
                with group_collective(groups[rank], "forward all-reduce"):
                    pass
            with probe.collective("loss all-reduce", "world", [0, 1]):
                pass
        with tp[0].device(2), tp[1].device(2):
            _wait_for(lambda: len(recorder.aborted) == 2)
    assert len(recorder.aborted) == 2, recorder.lines
    late = "not arrived in forward all-reduce (#3 on channel tp group [0, 1]): rank 1 ("
    mine, theirs = sorted(recorder.aborted)
    assert re.match(r"rank 0 \(.*\) has waited \d+ s for the device \(step 2\) at step 2; ", mine), mine
    assert late in mine, mine
    assert re.search(r"rank 1 \([^)]*step 2, in starting for \d+ s, waiting for the device \(step 2\)\)", mine), mine
    issued = "forward all-reduce (#3 on channel tp group [0, 1]), loss all-reduce (#1 on channel world)"
    assert f"last issued: {issued}" in mine
    assert theirs.startswith("rank 1 (") and late + "this rank)" in theirs, theirs
    assert group_collective(groups[0], "forward all-reduce").__class__.__name__ == "nullcontext"  # closed: forgotten


def test_a_device_merely_slow_is_reported_but_not_aborted() -> None:
    """Every rank issued as much on every channel: a long step, or a collective every rank entered, which the
    backend's own timeout ends; the inspector warns and leaves the job running."""
    recorder = _Recorder()
    watch, peer, _server = _watches(recorder, warn_s=0.2, abort_s=0.4)
    with watch, peer:
        for stall in (watch, peer):
            with stall.waiting("loss all-reduce", "world", [0, 1]):
                pass
        with watch.device(3), peer.device(3):
            _wait_for(lambda: len(recorder.lines) >= 8, seconds=5)
    assert not recorder.aborted, recorder.aborted
    assert all("every peer issued as many operations on every channel" in line for line in recorder.lines)
    assert all(line.startswith("hpc: stall: rank ") for line in recorder.lines), recorder.lines


def test_the_hosts_wait_for_a_steps_cuda_event_is_a_wait_on_the_device() -> None:
    """``RunRecords.settle`` reads a GPU step's numbers behind its CUDA event: a hung device is reported."""
    import torch

    from hpc.observe.probe import Probe
    from jobs.train.loop import RunRecords, StepReport

    recorder = _Recorder()
    watch, peer, _server = _watches(recorder, warn_s=0.2, abort_s=30)
    reported = re.compile(r"^hpc: stall: rank 0 \(.*\) has waited \d+ s for the device \(step 5\) at step 0; ")

    class HungEvent:  # a CUDA event behind work that does not finish until the inspector has reported it
        def synchronize(self) -> None:
            _wait_for(lambda: any(reported.match(line) for line in recorder.lines))

    records = RunRecords.__new__(RunRecords)
    records.probe, records.last_ready, records.clock, done = Probe(stall=watch), None, time.perf_counter(), []
    records.step_done = lambda *args: done.append(args)
    records.held = StepReport(4, 0.1, torch.tensor([2.0, 1.0]), HungEvent(), 1, None, None, lambda _: {})
    with watch, peer:
        records.settle()
    assert any(reported.match(line) for line in recorder.lines), recorder.lines
    assert done and done[0][0] == 4


SKIPPER = '''\
"""The built-in GPT, but rank 1 never enters one TP all-reduce at step 2: it sleeps in its place, alive."""
import time
from pathlib import Path

import torch.distributed as dist

import jobs.train.loop
import parallel.tensor_parallel as tp
from jobs.models.gpt import gpt

_run, _all_reduce = jobs.train.loop.StepRunner.run, tp._all_reduce
now = {"step": -1, "skipped": False}


def _run_step(self, step):
    now["step"] = step
    return _run(self, step)


def _skipping(x, group, *name):
    if now["step"] == 1 and not now["skipped"] and dist.get_rank() == 1:
        now["skipped"] = True
        Path("skipped_at").write_text(repr(time.time()))
        time.sleep(600)
    return _all_reduce(x, group, *name)


def build(**args):
    jobs.train.loop.StepRunner.run, tp._all_reduce = _run_step, _skipping
    return gpt(**args)
'''


@pytest.mark.parametrize(("timeout_s", "stall_abort_s"), [(6, 60), (60, 5)], ids=["backend-timeout", "stall-abort"])
def test_a_rank_that_skips_a_tp_all_reduce_is_named_by_hpc_run_status_and_logs(
        tmp_path: Path, timeout_s: int, stall_abort_s: int) -> None:
    """hpc run -n 2 of a TP=2 GPT whose rank 1 never enters step 2's first TP all-reduce (#13 on the TP group: a
    step issues 12, 5 forward, 2 in the loss, 5 backward): within the first of the backend's timeout and the stall
    abort + 10 s the job ends, and its first line, and hpc status's and hpc logs', names the group, the
    operation, its number and rank 1."""
    import os
    import sys

    from hpc.rundir import read_failures, write_failure
    from slurm.job_registry import JobRecord, Registry, failure_lines

    (tmp_path / "skipper.py").write_text(SKIPPER)
    (tmp_path / "job.toml").write_text(textwrap.dedent(f"""\
        [job]
        name = "skipped"
        run_dir = "{tmp_path}"
        [model]
        entry = "skipper:build"
        seq_len = 16
        args = {{ vocab_size = 256, seq_len = 16, d_model = 32, n_heads = 2, n_layers = 2 }}
        [data]
        name = "licenses"
        batch_size = 8
        [train]
        steps = 4
        stall_warn_s = 2
        stall_abort_s = {stall_abort_s}
        [parallel]
        tp = 2
        timeout_s = {timeout_s}
    """))
    done = subprocess.run([sys.executable, "-m", "hpc.cli.main", "run", "-n", "2", "--launcher", "local", "job.toml"],
                          capture_output=True, text=True, timeout=200, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    ended = time.time()
    assert done.returncode != 0 and (tmp_path / "skipped_at").exists(), done.stdout + done.stderr
    assert ended - float((tmp_path / "skipped_at").read_text()) < min(timeout_s, stall_abort_s) + 10
    first = next(line for line in done.stderr.splitlines() if line.startswith("hpc: error:"))
    named = "in forward all-reduce (#13 on channel tp group [0, 1]) at step 2; not arrived: rank 1 ("
    assert first.startswith("hpc: error: rank 0 (") and named in first, first
    [record] = [record for record in read_failures(tmp_path / "skipped") if not record.get("peer_lost")]
    record["job_id"] = "12"  # as a Slurm job's ranks label it: hpc status and hpc logs read the same record
    write_failure(tmp_path / "run12", 0, record, None)
    runs = (str(tmp_path / "run12"),)
    Registry(tmp_path / "home" / "jobs").add(JobRecord("12", "skipped", 2, str(tmp_path / "logs"), runs))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "12_0_log.out").write_text(done.stderr)
    env = {**os.environ, "HPC_HOME": str(tmp_path / "home")}
    logs = subprocess.run([sys.executable, "-m", "hpc.cli.main", "logs", "12"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    lead = f"job 12: {record['message']} -- see: hpc logs 12 --rank 0"
    assert logs.stdout.splitlines()[0] == lead and failure_lines(Registry.default(env).recent()) == [lead]
    assert lead.startswith("job 12: rank 0 (") and named in lead


def _node_check(world, run_dir: str, broken_rank: int) -> object:
    """Ranks as if each on its own node (local rank 0); ``broken_rank``'s scratch is a file, not a directory."""
    import os

    from hpc.errors import NodeUnhealthy
    from hpc.observe.health import check_nodes
    from hpc.observe.probe import Probe
    from hpc.runtime.mesh import build_mesh, resolve_layout

    scratch = Path(run_dir) / f"scratch-{world.rank}"
    scratch.write_text("") if world.rank == broken_rank else scratch.mkdir()
    os.environ["SLURM_TMPDIR"] = str(scratch)
    try:
        return check_nodes(build_mesh(resolve_layout(2, 1, 1, 2), world.rank), Probe(), 30, 0, Path(run_dir))
    except NodeUnhealthy as exc:
        return str(exc)


def test_a_node_that_cannot_write_its_scratch_fails_its_health_check_by_name(tmp_path) -> None:
    import socket

    for run in ("a", "b"):
        (tmp_path / run).mkdir()
    healthy = run_ranks(2, _node_check, str(tmp_path / "a"), -1, timeout=60)
    assert healthy[0][0].startswith("health: run directory writes: slowest ") and healthy[0][1].startswith(
        "health: scratch writes: slowest ") and healthy[0][1].endswith("of 2 nodes")
    broken = run_ranks(2, _node_check, str(tmp_path / "b"), 1, timeout=60)
    scratch = tmp_path / "b" / "scratch-1"
    assert broken[1] == f"host {socket.gethostname()} failed its health check: scratch {scratch} is not writable: " \
                        "File exists (rank=1)"
    assert isinstance(broken[0], list)  # the healthy rank goes on (and would see its peer leave)
    assert not list((tmp_path / "a").glob(".hpc-health-*"))  # the probe files are removed


def _links_against(world, cluster_file: str) -> str | None:
    from hpc.errors import NodeUnhealthy
    from hpc.observe.health import check_mesh
    from hpc.observe.probe import Probe
    from hpc.runtime.mesh import build_mesh, resolve_layout
    from jobs.train.loop import check_links

    report = check_mesh(build_mesh(resolve_layout(2, 1, 1, 2), world.rank), Probe(), timeout_s=30,
                        message_bytes=1 << 16)
    try:
        check_links(report, cluster_file, world.rank)
    except NodeUnhealthy as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(("gbps", "fails"), [(1e6, True), (1e-3, False)])
def test_a_link_far_below_the_cluster_files_fails_the_health_check_on_one_rank(tmp_path, gbps, fails) -> None:
    """Against a cluster file whose links move 1 PB/s with no latency, this machine's loopback is far too slow:
    the rank the slowest link leads to fails, naming its host and the model's time; against 1 MB/s, none does."""
    import socket

    cluster = tmp_path / "model.toml"
    cluster.write_text(f'[cluster]\nname = "model"\nintra_alpha_us = 0\nintra_gbps = {gbps}\ninter_alpha_us = 0\n'
                       f"inter_gbps = {gbps}\n")
    results = run_ranks(2, _links_against, str(cluster), timeout=60)
    failed = [text for text in results if text]
    assert len(failed) == (1 if fails else 0), results
    if fails:
        # the world's and dp's rings are the same two links here: either may be the slowest
        assert re.match(rf"host {socket.gethostname()} failed its health check: the link (world|dp) rank [01] -> [01] ",
                        failed[0]), failed
        assert "x the 0.00 ms that model's model gives" in failed[0]


def _profiled_run(world, run_dir: str) -> str:
    from hpc.runtime.mesh import MeshShape, build_mesh
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"name": "profiled", "run_dir": run_dir},
        "model": {"kind": "gpt", "n_layers": 2, "d_model": 32, "n_heads": 2, "seq_len": 16},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": 7, "profile_steps": 2, "log_every": 100},
    })
    train(spec, world, build_mesh(MeshShape(2, 1, 1), world.rank))
    return str(spec.run_path)


def test_profile_steps_write_each_ranks_trace_and_its_ops_after_the_warm_up(tmp_path) -> None:
    """train.profile_steps = 2 of 7: steps 4 and 5 (the first 3 left out) in every rank's trace, and its ops
    table ranks the matrix products the GPT's step runs."""
    from hpc.observe.profile import PROFILE_AFTER

    run_path = Path(run_ranks(2, _profiled_run, str(tmp_path), timeout=120)[0])
    for rank in (0, 1):
        events = json.loads((run_path / "profile" / f"rank{rank}.trace.json").read_text())["traceEvents"]
        steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
        assert steps == [f"ProfilerStep#{PROFILE_AFTER}", f"ProfilerStep#{PROFILE_AFTER + 1}"]
        table = (run_path / "profile" / f"rank{rank}.ops.txt").read_text()
        assert "aten::mm" in table and "aten::addmm" in table
