"""``hpc plan`` (parallel/plan.py): the step model's arithmetic, the cluster files, the command, and the published
validation: Narayanan et al. SC21, Table 1 (docs/data/megatron_sc21_table1.csv), as docs/PLANNER.md reports it.

``python -m tests.test_plan`` prints the validation table of docs/PLANNER.md.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from dataclasses import asdict, replace
from functools import cache
from pathlib import Path

import pytest

from hpc.cli.main import main
from hpc.errors import ConfigError
from jobs.bench.plan_check import compare
from parallel.calibrate import fit_alpha_beta, fit_overhead_and_rate, median_cluster
from parallel.calibrate import testbed_cluster as namespace_testbed
from parallel.cluster import Cluster, builtin_clusters, cluster_toml, load_cluster
from parallel.plan import (
    MIXED_ADAM,
    Layout,
    Training,
    Transformer,
    all_to_all_s,
    best_of,
    dp_comm_s,
    estimate,
    layouts,
    memory_bytes,
    microbatch_parts,
    plan,
    ring_allreduce_s,
    spec_training,
    stage_params,
    tied_embedding_s,
)

REPO = Path(__file__).resolve().parents[1]
TABLE1 = REPO / "docs" / "data" / "megatron_sc21_table1.csv"
GPT = REPO / "jobs" / "examples" / "gpt.toml"
# Rows whose recommended (dp, tp, pp) is neither the published one nor within 5% of it, with the gap the planner
# predicts (docs/PLANNER.md says why); every other row must meet 5%.
RECOMMENDATION_MISSES = {"18.4": 0.10, "39.1": 0.10}
# This machine: the calibration (hpc plan --calibrate, the median of 3 rounds) and the measured layouts (hpc plan
# --validate --record, 3 runs each) that docs/PLANNER.md reports, taken one after the other on a quiet machine (the
# record keeps the load average); the testbed's rows were measured before them, with the link measured across it.
LOCAL_CLUSTER = REPO / "docs" / "data" / "plan_cluster_local.toml"
LOCAL_RECORD = REPO / "docs" / "data" / "plan_local.json"
TESTBED_RECORD = REPO / "docs" / "data" / "plan_testbed.json"  # DP, one rank per namespace host, 1 Gbit/s links
# Rows whose recorded step time the planner misses by more than 15%, with the ratio (predicted / measured) it
# gives them: docs/PLANNER.md says why. Every other row must meet 15%; every row's memory 10%.
LOCAL_TIME_MISSES = {"dp=2 zero=2": 0.822, "tp=2": 0.835}
TESTBED_TIME_MISSES: dict[str, float] = {}


@cache
def validation() -> tuple[dict, ...]:
    """Per Table 1 row: the published figures, the planner's prediction for the published (dp, tp, pp) and its own
    recommendation, both with activation recomputation and the DP all-reduce after backward, as Megatron-LM ran."""
    cluster = load_cluster("a100-superpod")
    lines = [line for line in TABLE1.read_text().splitlines() if not line.startswith("#")]
    out = []
    for row in csv.DictReader(lines):
        model = Transformer(int(row["layers"]), int(row["hidden"]), int(row["heads"]), 2048, 51200)
        train = replace(MIXED_ADAM, batch=int(row["batch"]), dp_overlap=False)
        tp, pp, gpus = int(row["tp"]), int(row["pp"]), int(row["gpus"])
        result = plan(model, train, cluster, gpus)
        with_recompute = tuple(e for e in result.fitting if e.layout.checkpointing == "full")  # Megatron-LM's
        published = best_of(with_recompute, gpus // (tp * pp), tp, pp)
        out.append({"row": row, "model": model, "published": published, "recommended": with_recompute[0],
                    "overall": result.fitting[0]})
    return tuple(out)


def test_the_parameter_count_matches_table_1() -> None:
    for case in validation():
        assert case["model"].params / 1e9 == pytest.approx(float(case["row"]["params_billion"]), abs=0.05)


@pytest.mark.parametrize("index", range(10))
def test_predicted_throughput_per_gpu_is_within_15_percent_of_table_1(index: int) -> None:
    case = validation()[index]
    assert case["published"] is not None, "the published layout must fit in memory"
    published = float(case["row"]["tflops_per_gpu"])
    assert case["published"].tflops_per_gpu == pytest.approx(published, rel=0.15)


@pytest.mark.parametrize("index", range(10))
def test_the_recommended_layout_is_the_published_one_or_within_5_percent(index: int) -> None:
    case = validation()[index]
    gap = case["published"].step_s / case["recommended"].step_s - 1
    assert gap <= RECOMMENDATION_MISSES.get(case["row"]["params_billion"], 0.05)
    if case["row"]["params_billion"] in RECOMMENDATION_MISSES:
        assert gap > 0.05  # still a miss: when it no longer is, move the row out of RECOMMENDATION_MISSES


def test_ring_allreduce_is_alpha_beta_with_the_rings_volume() -> None:
    link = (1e-5, 1e9)
    assert ring_allreduce_s(1e9, 1, link) == 0
    assert ring_allreduce_s(1e9, 4, link) == pytest.approx(6 * 1e-5 + 1.5)


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1_divided_by_v() -> None:
    model = Transformer(16, 1024, 16, 1024, 8)  # a head too small to unbalance the stages
    fast = dict(intra_alpha_us=0, inter_alpha_us=0, intra_gbps=1e9, inter_gbps=1e9, memory_gbps=1e12)
    cluster = replace(load_cluster("a100-superpod"), **fast)  # links and the optimizer's update cost ~nothing
    train = replace(MIXED_ADAM, batch=64)
    for m, schedule, v in ((4, "1f1b", 1), (16, "gpipe", 1), (16, "interleaved", 2), (16, "interleaved", 4)):
        e = estimate(model, train, cluster, Layout(1, 1, 4, m, schedule, v))
        assert e.shares()["pp"] == pytest.approx(3 / v / (m + 3 / v), rel=1e-3)
        assert sum(e.shares().values()) == pytest.approx(1)


def test_the_last_stage_holds_the_head_and_the_other_stages_make_the_bubble() -> None:
    """The head's logits, loss and their TP collectives lengthen every slot of the last stage, the slowest; the
    pipeline fills and drains through the other stages, so the bubble's slots are theirs."""
    model, cluster = Transformer(16, 1024, 16, 1024, 51200), load_cluster("a100-superpod")
    train, lay = replace(MIXED_ADAM, batch=64), Layout(1, 2, 4, 16)
    last, other = sum(microbatch_parts(model, train, cluster, lay)), sum(microbatch_parts(model, train, cluster, lay,
                                                                                         head=False))
    assert last > other * 1.5  # a 51200-word head at h = 1024 outweighs the stage's four layers
    e = estimate(model, train, cluster, lay)
    tied = tied_embedding_s(model, train, cluster, lay)  # the first and last stages' embedding group
    assert e.compute_s + e.tp_s + e.pp_s == pytest.approx(16 * last + 3 * other + tied, rel=1e-9)


def test_a_tied_embedding_under_a_pipeline_all_reduces_its_gradient_between_the_first_and_last_stage() -> None:
    """parallel/tied.py: the two copies' gradients summed over the 2-rank embedding group, its tp share, on the
    link the whole job spans, after backward (nothing hides it); none on one stage or with an untied head."""
    model, cluster = Transformer(16, 1024, 16, 1024, 51200), load_cluster("a100-superpod")
    train, lay = replace(MIXED_ADAM, batch=64), Layout(2, 2, 4, 16)
    expected = ring_allreduce_s(51200 * 1024 / 2 * 2, 2, cluster.link(16))
    assert tied_embedding_s(model, train, cluster, lay) == pytest.approx(expected) and expected > 0
    untied = replace(model, tied=False)
    assert tied_embedding_s(untied, train, cluster, lay) == 0 == tied_embedding_s(model, train, cluster,
                                                                                  replace(lay, pp=1))
    step = estimate(model, train, cluster, lay).step_s
    assert step - estimate(untied, train, cluster, lay).step_s == pytest.approx(expected, rel=1e-6)
    counted = replace(model, counted=(51200 * 1024, 12 * 1024**2, 51200 * 1024), shared=51200 * 1024)
    assert tied_embedding_s(counted, train, cluster, lay) == pytest.approx(expected)


def test_each_microbatch_after_the_first_adds_its_gradients_to_the_stages() -> None:
    """Splitting a step into m microbatches costs m - 1 gradient accumulations (read both, write the sum) of the
    stage's parameters at memory bandwidth, and nothing else on a GPU: the FLOPs and bytes per token are the same."""
    model, cluster = Transformer(8, 1024, 16, 1024, 51200), load_cluster("a100-superpod")
    train = replace(MIXED_ADAM, batch=64)
    whole = estimate(model, train, cluster, Layout(1, 1, 2, 1))
    for m in (2, 8, 32):
        lay = Layout(1, 1, 2, m)
        added = (m - 1) * stage_params(model, lay) * 3 * train.grad_bytes / (cluster.memory_gbps * 1e9)
        assert estimate(model, train, cluster, lay).compute_s - whole.compute_s == pytest.approx(added, rel=1e-6)


def test_megatrons_scatter_gather_sends_a_tp_share_and_our_pipeline_the_whole_activation() -> None:
    model, cluster = Transformer(8, 1024, 16, 1024, 51200), load_cluster("a100-superpod")
    train, lay = replace(MIXED_ADAM, batch=64), Layout(1, 4, 2, 8)
    beta = cluster.link(8)[1]
    message = 64 // 8 * 1024 * 1024 * train.act_bytes  # b s h
    split = estimate(model, train, cluster, lay).pp_s
    whole = estimate(model, replace(train, p2p_split_over_tp=False), cluster, lay).pp_s
    slots = lay.microbatches + lay.pp - 1  # the bubble's slots carry the sends too
    assert whole - split == pytest.approx(slots * 2 * message * (1 - 1 / 4) / beta, rel=1e-6)


def test_memory_follows_the_schedule_checkpointing_and_zero() -> None:
    model = Transformer(32, 4096, 32, 2048, 51200)
    cluster = load_cluster("a100-superpod")
    train = replace(MIXED_ADAM, batch=256)
    mem = {}
    for schedule in ("gpipe", "1f1b"):
        for ckpt in ("", "selective", "full"):
            mem[schedule, ckpt] = memory_bytes(model, train, cluster, Layout(2, 2, 4, 32, schedule, 1, ckpt))
    assert mem["gpipe", ""] > mem["1f1b", ""] > mem["1f1b", "selective"] > mem["1f1b", "full"]
    assert mem["gpipe", ""] > mem["gpipe", "selective"] > mem["gpipe", "full"]
    zero = [memory_bytes(model, train, cluster, Layout(8, 2, 2, 4, zero=z)) for z in range(4)]
    assert zero == sorted(zero, reverse=True) and len(set(zero)) == 4


def test_selective_checkpointing_keeps_less_than_none_redoes_less_than_full_and_wins_when_memory_binds(
        capsys) -> None:
    """Selective checkpointing (train.recompute) keeps each layer's products: less memory than keeping everything,
    more than full recomputation's layer inputs; it recomputes no product, so its step is shorter than full's and
    longer than none's (its elementwise work and TP all-reduces are redone). Where keeping everything fits nowhere,
    the planner picks it."""
    model, cluster = Transformer(32, 4096, 32, 2048, 51200), load_cluster("a100-superpod")
    train = replace(MIXED_ADAM, batch=64)
    e = {ckpt: estimate(model, train, cluster, Layout(2, 2, 2, 8, "1f1b", 1, ckpt)) for ckpt in ("", "selective",
                                                                                                  "full")}
    assert e[""].memory_bytes > e["selective"].memory_bytes > e["full"].memory_bytes
    assert e[""].step_s < e["selective"].step_s < e["full"].step_s
    executed = {ckpt: est.tflops_per_gpu * est.step_s for ckpt, est in e.items()}
    assert executed["selective"] == pytest.approx(executed[""]) and executed["full"] > executed[""] * 1.2
    tight = replace(cluster, memory_gib=16 / cluster.usable_memory)  # 16 GiB: keeping everything needs 18.3 at least
    result = plan(model, train, tight, 8)
    assert result.fitting and all(fit.layout.checkpointing for fit in result.fitting)
    assert result.fitting[0].layout.checkpointing == "selective"
    assert main(["plan", *ONE_T, "--gpus", "3072", "--checkpointing", "selective", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fitting"] and {row["layout"]["checkpointing"] for row in data["layouts"]} == {"selective"}
    assert main(["plan", *ONE_T, "--layout", "dp=3,tp=8,pp=128,m=1024,ckpt=selective"]) == 0
    assert capsys.readouterr().out.splitlines()[2].startswith("dp=3 tp=8 pp=128 m=1024 1f1b sac ")
    selective = ["--set", "train.activation_checkpointing=true", "--set", "train.recompute=selective"]
    assert main(["plan", str(GPT), "--cluster", "a100-superpod", "--gpus", "8", *selective]) == 0
    assert "the spec's layout, dp=2 tp=2 pp=2 m=4 1f1b sac: number " in capsys.readouterr().out


def test_built_in_clusters_load_and_a_bad_value_names_its_key(tmp_path: Path) -> None:
    assert {"a100-superpod", "h100-dgx"} <= set(builtin_clusters())
    assert load_cluster("h100-dgx").peak_flops("bf16") > load_cluster("a100-superpod").peak_flops("bf16")
    bad = tmp_path / "c.toml"
    bad.write_text("[cluster]\nmemory_gib = -1\n")
    with pytest.raises(ConfigError, match=r"cluster\.memory_gib must be > 0"):
        load_cluster(bad)
    bad.write_text("[cluster]\nmemory_gb = 80\n")
    with pytest.raises(ConfigError, match=r"did you mean cluster\.memory_gib"):
        load_cluster(bad)
    with pytest.raises(ConfigError, match="no such cluster file"):
        load_cluster(tmp_path / "missing.toml")


def test_hpc_plan_ranks_the_gpt_of_a_spec_and_recommends_one(capsys) -> None:
    assert main(["plan", str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recommended: dp=" in out and "tokens/s" in out
    assert "the spec's layout, dp=2 tp=2 pp=2 m=4 1f1b: number " in out  # gpt.toml's [parallel], dp auto
    assert main(["plan", str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"]["layout"] == data["layouts"][0]["layout"] and data["fitting"] >= len(data["layouts"])


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw", "lamb", "lars"])
def test_every_optimizer_of_the_spec_is_planned(capsys, optimizer) -> None:
    args = ["plan", str(GPT), "--set", f"train.optimizer={optimizer}", "--cluster", "a100-superpod", "--gpus", "8"]
    assert main(args) == 0, capsys.readouterr().err
    assert "recommended: dp=" in capsys.readouterr().out


def test_a_model_that_fits_nowhere_says_by_how_much(capsys) -> None:
    model = "layers=128,hidden=25600,heads=160,seq=2048,vocab=51200"
    assert main(["plan", "--model", model, "--batch", "8", "--cluster", "a100-superpod", "--gpus", "8"]) == 1
    out = capsys.readouterr().out
    assert "no layout fits: the leanest" in out and "more than the usable" in out


def test_bad_input_is_one_line(capsys, tmp_path: Path) -> None:
    spec = tmp_path / "mlp.toml"
    spec.write_text('[model]\nkind = "mlp"\n')
    assert main(["plan", str(spec), "--cluster", "a100-superpod", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "hpc plan cannot count model.entry='jobs.models.mlp:mlp': it has no pipeline_parts()" in err
    assert main(["plan", "--model", "layers=2,hidden=64", "--batch", "8", "--cluster", "h100-dgx", "--gpus", "2"]) == 2
    assert "--model is missing heads, seq, vocab" in capsys.readouterr().err


ONE_T = ["--model", "layers=128,hidden=25600,heads=160,seq=2048,vocab=51200", "--batch", "3072",
         "--cluster", "a100-superpod", "--no-overlap"]  # Megatron-LM's 1T run, as docs/PLANNER.md plans it


def test_hpc_plan_layout_predicts_the_one_layout_given(capsys) -> None:
    """Issue 28: one layout's prediction, without filtering it out of --json --top 1000000."""
    asked = "dp=6,tp=8,pp=64,m=512,schedule=interleaved/2,ckpt=on"
    assert main(["plan", *ONE_T, "--layout", asked]) == 0  # --gpus: dp tp pp
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"on 3072 x A100 DGX SuperPOD (Selene): 1 layout matches --layout {asked}, 1 fit in "
                             "72.0 GiB per rank")
    assert len(lines) == 4 and lines[2].split()[:10] == ["dp=6", "tp=8", "pp=64", "m=512", "interleaved/2", "ckpt",
                                                        "113", "s", "55,547", "148"]
    assert lines[3] == ("dp=6 tp=8 pp=64 m=512 interleaved/2 ckpt: number 2 of the 40 fitting layouts of 3072 "
                        "ranks, predicted +13% against the recommended, dp=3 tp=8 pp=128 m=1024 1f1b sac")
    assert main(["plan", *ONE_T, "--layout", "dp=6,tp=8,pp=64,m=512,schedule=1f1b,ckpt=on", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    model = Transformer(128, 25600, 160, 2048, 51200)
    lay = Layout(6, 8, 64, 512, "1f1b", 1, "full")
    expected = estimate(model, replace(MIXED_ADAM, batch=3072, dp_overlap=False), load_cluster("a100-superpod"), lay)
    assert (data["fitting"], data["considered"]) == (1, 1) and data["layout_asked"].endswith("schedule=1f1b,ckpt=on")
    assert data["recommended"]["step_s"] == expected.step_s and data["recommended"]["layout"]["schedule"] == "1f1b"


def test_hpc_plan_layout_chooses_what_it_leaves_out_as_the_planner_would(capsys) -> None:
    assert main(["plan", *ONE_T, "--layout", "dp=6,tp=8,pp=64", "--top", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    full = plan(Transformer(128, 25600, 160, 2048, 51200), replace(MIXED_ADAM, batch=3072, dp_overlap=False),
                load_cluster("a100-superpod"), 3072)
    assert data["recommended"]["step_s"] == best_of(full.fitting, 6, 8, 64).step_s
    assert len(data["layouts"]) == 2 and data["fitting"] == 4 and data["considered"] == 72
    assert main(["plan", *ONE_T, "--layout", "dp=6,tp=8,pp=64,m=1,schedule=1f1b,ckpt=off"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        "dp=6 tp=8 pp=64 m=1 1f1b does not fit: it needs 1106.7 GiB per rank, 1034.7 GiB more than the usable "
        "72.0 GiB")


@pytest.mark.parametrize(("layout", "extra", "message"), [
    ("dp=6,tp=7,pp=64", [], "--layout dp=6,tp=7,pp=64: tp=7 does not divide the model's 160 heads"),
    ("dp=6,tp=8,pp=63", [], "pp=63 does not divide the model's 128 layers"),
    ("dp=5,tp=8,pp=64", ["--gpus", "2560"], "dp=5 does not divide the global batch of 3072 sequences"),
    ("dp=6,tp=8,pp=64,m=3", [], "m=3 does not divide a replica's batch of 512 sequences"),
    ("dp=6,tp=8,pp=64,m=4,schedule=interleaved", [], "interleaved needs m a multiple of pp=64, got m=4"),
    ("dp=6,tp=8,pp=64,schedule=interleaved/3", [], "interleaved/3: 3 does not divide a stage's 2 layers"),
    ("dp=3072,tp=1,pp=1,schedule=gpipe", [], "schedule=gpipe needs a pipeline (pp > 1)"),
    ("dp=6,tp=8,pp=64,ep=2", [], "ep=2 needs a mixture of experts"),
    ("dp=1,tp=8,pp=64,zero=1", ["--gpus", "512"], "ZeRO shards over data parallelism: it needs dp > 1"),
    ("dp=6,tp=8", [], "--layout is missing pp (give at least dp=,tp=,pp=)"),
    ("dp=6,tp=8,pp=64,v=2", [], "--layout v=2: expected KEY=VALUE with KEY one of dp, tp, pp, m, schedule, ckpt"),
    ("dp=6,tp=8,pp=64,dp=6", [], "--layout gives dp twice"),
    ("dp=6,tp=8,pp=x", [], "--layout pp must be a positive integer, got x"),
    ("dp=6,tp=8,pp=64,zero=4", [], "--layout zero must be 0, 1, 2 or 3, got 4"),
    ("dp=6,tp=8,pp=64,ckpt=yes", [], "--layout ckpt must be off, selective or on, got yes"),
    ("dp=6,tp=8,pp=64,schedule=interleaved/1", [], "or interleaved/V with V at least 2, got interleaved/1"),
    ("dp=6,tp=8,pp=64", ["--gpus", "16"], "--layout dp=6 tp=8 pp=64 is 3072 ranks, --gpus 16"),
    ("dp=6,tp=8,pp=64,ckpt=off", ["--checkpointing", "on"], "--layout ckpt=off contradicts --checkpointing on"),
    ("dp=6,tp=8,pp=64,ckpt=selective", ["--checkpointing", "on"],
     "--layout ckpt=selective contradicts --checkpointing on"),
])
def test_a_bad_layout_is_one_line_naming_the_problem(capsys, layout, extra, message) -> None:
    assert main(["plan", *ONE_T, "--layout", layout, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_every_layout_the_planner_considers_can_be_asked_for_alone() -> None:
    """--layout's checks agree with layouts(): none of its layouts is refused, and all its keys name only it."""
    from parallel.plan import layout_problem as _layout_problem
    from parallel.plan import matches as _matches

    every = list(layouts(MOE, MOE_TRAIN, 8, (0, 1, 2, 3)))
    assert len(every) > 100
    for lay in every:
        want = {"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "m": lay.microbatches, "ckpt": lay.checkpointing,
                "zero": lay.zero, "ep": lay.ep,
                "schedule": (lay.schedule, lay.virtual_stages if lay.schedule == "interleaved" else None)}
        assert _layout_problem(MOE, MOE_TRAIN, want) is None, lay
        assert [other for other in every if _matches(other, want)] == [lay]


def test_hpc_plan_refuses_a_set_it_would_ignore(capsys) -> None:
    """Issue 28: --set with --model, or of a key the planner does not read, exited 0 having changed nothing."""
    cases = [
        ([*ONE_T, "--gpus", "8", "--set", "parallel.tp=2", "--set", "bogus.key=1"],
         "--set parallel.tp=2: hpc plan --model reads no job spec, so --set has nothing to change"),
        ([str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--set", "bogus.key=1"],
         "--set bogus.key=1: unknown key bogus"),
        ([str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--set", "train.lr=1"],
         "--set train.lr=1: hpc plan does not use train.lr (it reads model.kind, "),
        ([str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--set", "parallel.zero=1"],
         "--set parallel.zero=1: hpc plan does not use parallel.zero (--zero considers every ZeRO stage"),
        ([str(GPT), "--cluster", "a100-superpod", "--set", "parallel.tp=4", "--layout", "dp=2,tp=2,pp=2"],
         "--set parallel.tp=4: hpc plan --layout does not use the spec's layout; give it in --layout"),
        ([str(GPT), "--cluster", "a100-superpod", "--gpus", "8", "--batch", "16", "--set", "data.batch_size=8"],
         "--set data.batch_size=8: --batch gives the batch; give one or the other"),
        (["--calibrate", "--set", "train.lr=1"], "--set train.lr=1: hpc plan --calibrate reads no job spec"),
    ]
    for args, message in cases:
        assert main(["plan", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    used = ["--set", "parallel.tp=4", "--set", "parallel.pp=1", "--set", "parallel.compression=int8"]
    assert main(["plan", str(GPT), "--cluster", "a100-superpod", "--gpus", "8", *used]) == 0
    assert "the spec's layout, dp=2 tp=4 pp=1 m=4 1f1b: number " in capsys.readouterr().out


def test_the_planner_imports_no_torch() -> None:
    code = ("import sys, parallel.plan, parallel.cluster, hpc.cli.plan\n"
            "print(sorted(m for m in ('torch', 'numpy', 'h5py') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stderr


def test_alpha_and_beta_are_fitted_to_ring_measurements() -> None:
    alpha, beta = 2e-5, 3e9
    samples = [(n, k, ring_allreduce_s(n, k, (alpha, beta))) for n in (4e3, 1e6, 16e6) for k in (2, 4)]
    assert fit_alpha_beta(samples) == pytest.approx((alpha, beta), rel=1e-6)
    # A shaped link's burst: mid-sized messages 30% faster than its rate. The ends still give the model's two uses
    # (a least squares fit over every size put this latency at 0).
    shaped = [(n, 2, ring_allreduce_s(n, 2, (alpha, beta)) * (0.7 if 4e3 < n < 16e6 else 1.0))
              for n in (4e3, 64e3, 1e6, 4e6, 16e6)]
    assert fit_alpha_beta(shaped) == pytest.approx((alpha, beta), rel=1e-6)
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([(1e6, 2, 1e-3), (1e6, 2, 1e-3)])


def test_a_written_cluster_file_reads_back(tmp_path: Path) -> None:
    cluster = replace(load_cluster("h100-dgx"), name="here", intra_alpha_us=1361.5)
    path = tmp_path / "here.toml"
    path.write_text(cluster_toml(cluster))
    assert load_cluster(path) == cluster


def test_calibrate_replaces_only_a_cluster_file_it_wrote(tmp_path: Path, capsys, monkeypatch) -> None:
    """--out over a job spec (or any file the calibration did not write) is refused before minutes of measuring,
    the file untouched; its own earlier output is replaced whole."""
    import jobs.bench.calibrate

    spec = tmp_path / "job.toml"
    spec.write_text(GPT.read_text())
    assert main(["plan", "--calibrate", "--launcher", "local", "--out", str(spec)]) == 2
    assert capsys.readouterr().err == (f"hpc: error: --out {spec}: the file exists and is not a cluster file hpc plan "
                                       "--calibrate wrote (it replaces only those): give another --out, or move the "
                                       "file away\n")
    assert spec.read_text() == GPT.read_text()
    measured = replace(load_cluster("h100-dgx"), name="here")
    monkeypatch.setattr(jobs.bench.calibrate, "calibrate",
                        lambda *_: (measured, {field: [getattr(measured, field)] for field in asdict(measured)}))
    out = tmp_path / "local.toml"
    out.write_text(cluster_toml(load_cluster("a100-superpod")))
    assert main(["plan", "--calibrate", "--launcher", "local", "--out", str(out)]) == 0
    assert out.read_text() == cluster_toml(measured)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["job.toml", "local.toml"]


@pytest.mark.slow
def test_calibrate_measures_this_machine_and_writes_a_cluster_file(tmp_path: Path, capsys) -> None:
    out = tmp_path / "local.toml"
    assert main(["plan", "--calibrate", "-n", "2", "--launcher", "local", "--out", str(out), "--repeats", "1"]) == 0
    assert "median of 1 rounds" in capsys.readouterr().out  # one round: the rounds' median is tested below, alone
    cluster = load_cluster(out)
    assert cluster.cores_per_node > 0 and cluster.intra_gbps > 0 and cluster.peak_tflops_fp32 > 0
    assert cluster.rank_base_mib > 100 and cluster.tensor_overhead_us > 0  # a rank imports torch; Adam loops
    assert cluster.optimizer_traffic >= 1 and cluster.int8_encode_ns > cluster.int8_hop_ns > 0  # an encode decodes too
    assert 1 <= cluster.thread_speedup <= cluster.cores_per_node
    assert main(["plan", str(GPT), "--cluster", str(out), "--gpus", "2"]) == 0
    assert "recommended: dp=" in capsys.readouterr().out


def test_a_link_measured_several_times_is_the_median_of_its_fits() -> None:
    from jobs.bench.plan_check import median_fit

    assert median_fit([(3e-4, 1.2e8), (9e-4, 1.1e8), (5e-4, 1.3e8)]) == (5e-4, 1.2e8)  # each its own median
    assert median_fit([(2e-4, 0.6e9)]) == (2e-4, 0.6e9)


def test_a_calibration_keeps_each_measured_constant_s_median_of_the_rounds() -> None:
    rounds = [replace(load_cluster("h100-dgx"), intra_gbps=gbps, inter_alpha_us=alpha, name=f"round {i}")
              for i, (gbps, alpha) in enumerate([(3.0, 9.0), (1.0, 30.0), (2.0, 10.0)])]
    cluster, measured = median_cluster(rounds)
    assert (cluster.intra_gbps, cluster.inter_alpha_us, cluster.name) == (2.0, 10.0, "round 0")
    assert measured["intra_gbps"] == [3.0, 1.0, 2.0] and measured["inter_alpha_us"] == [9.0, 30.0, 10.0]
    assert cluster.devices_per_node == rounds[0].devices_per_node  # counts are the first round's, not medians


@cache
def local_validation() -> tuple[dict, ...]:
    """The recorded measurements of docs/data/plan_local.json and plan_testbed.json against the planner's
    prediction, recomputed now from the recorded cluster file (the testbed: its node, and the link as measured
    across it before the runs)."""
    cluster = load_cluster(LOCAL_CLUSTER)
    local = compare(str(GPT), json.loads(LOCAL_RECORD.read_text())["rows"], cluster)
    record = json.loads(TESTBED_RECORD.read_text())
    link = (record["cluster"]["inter_alpha_us"] * 1e-6, record["cluster"]["inter_gbps"] * 1e9)  # measured there
    testbed = compare(str(GPT), record["rows"], namespace_testbed(cluster, "1gbit", link))
    return (*local, *({**row, "label": f"testbed {row['label']}"} for row in testbed))


def test_the_local_validation_covers_the_layouts_issue_19_names() -> None:
    labels = {row["label"] for row in local_validation()}
    assert len(labels) >= 9
    needed = {"dp=2", "dp=2 fp16", "tp=2", "pp=2 gpipe", "pp=2 1f1b", "pp=2 interleaved", "dp=2 zero=1",
              "dp=2 zero=2", "dp=2 zero=3", "testbed dp=2"}
    assert needed <= labels


@pytest.mark.parametrize("index", range(14))
def test_predicted_peak_memory_is_within_10_percent_of_the_measured(index: int) -> None:
    row = local_validation()[index]
    assert row["memory_ratio"] == pytest.approx(1.0, abs=0.10), row["label"]


@pytest.mark.parametrize("index", range(14))
def test_predicted_step_time_is_within_15_percent_of_the_measured_median(index: int) -> None:
    row = local_validation()[index]
    misses = {**LOCAL_TIME_MISSES, **{f"testbed {k}": v for k, v in TESTBED_TIME_MISSES.items()}}
    if row["label"] in misses:  # the recorded miss, reproduced: the arithmetic stays pinned
        assert row["step_ratio"] == pytest.approx(misses[row["label"]], abs=0.01)
    else:
        assert row["step_ratio"] == pytest.approx(1.0, abs=0.15), row["label"]


# Issue 41's exchange cut by node on the testbed: 2 hosts of 2 ranks (a NIC per rank, 1 Gbit/s; the loopback inside a
# host, measured with every host's ranks busy; each link the median of 3 fits through its smallest and largest
# messages), the GPT example at its width and at 256, flat and cut, uncompressed and int8, predicted with a calibration
# of this machine made just before (docs/data/plan_cluster_testbed_nodes.toml: with the int8 codec's and the
# optimizer's CPU cost).
# The _shm records: the node's stages through its shared memory (parallel/node_memory.py), on a 2-core AMD EPYC with
# its own calibration (docs/data/plan_cluster_testbed_nodes_shm.toml), session 28. The _host_kernels record: int8 in
# the host's fused C kernels (parallel/compression/host_kernels.py), calibrated anew (0.645 ns an encode against
# 0.95), session 29.
NODE_RECORDS = ("plan_testbed_nodes.json", "plan_testbed_nodes_rerun.json", "plan_testbed_nodes_wide.json",
                "plan_testbed_nodes_shm.json", "plan_testbed_nodes_shm_rerun.json", "plan_testbed_nodes_shm_wide.json",
                "plan_testbed_nodes_host_kernels.json")
NODE_LAYOUTS = {"2x2 dp=4", "2x2 dp=4 cut", "2x2 dp=4 int8", "2x2 dp=4 int8 cut"}
# session 24's first run at width 128 (load average up to 3.5): the int8 cut measured 134 ms, 112 in the run after;
# session 28's flat rows at width 128, predicted too slow on the EPYC (the cut's rows within 15% in every run)
NODE_TIME_MISSES = {("plan_testbed_nodes.json", "2x2 dp=4 int8 cut"): 0.844,
                    ("plan_testbed_nodes_shm.json", "2x2 dp=4 int8"): 1.183,
                    ("plan_testbed_nodes_shm_rerun.json", "2x2 dp=4"): 1.186}


@pytest.mark.parametrize("name", NODE_RECORDS)
def test_nodes_of_two_ranks_on_the_testbed_are_predicted_with_their_loopback_and_a_link_per_rank(name) -> None:
    """The recorded rows recomputed from their record (the testbed's cluster: the link and the loopback as measured
    there, each row's ranks per host as its node): the step within 15%, peak memory within 10%, and the cut
    predicted faster than the flat ring uncompressed, as measured."""
    record = json.loads((REPO / "docs" / "data" / name).read_text())
    rows = {row["label"]: row for row in compare(str(GPT), record["rows"], Cluster(**record["cluster"]))}
    assert set(rows) == NODE_LAYOUTS and all(row["ranks_per_host"] == 2 for row in rows.values())
    for label, row in rows.items():
        miss = NODE_TIME_MISSES.get((name, label))
        if miss is not None:  # the recorded miss, reproduced
            assert row["step_ratio"] == pytest.approx(miss, abs=0.01) and abs(row["step_ratio"] - 1) > 0.15, label
        else:
            assert row["step_ratio"] == pytest.approx(1.0, abs=0.15), label
        assert row["memory_ratio"] == pytest.approx(1.0, abs=0.10), label
    for key in ("predicted_step_s", "step_s"):
        assert rows["2x2 dp=4 cut"][key] < rows["2x2 dp=4"][key]


def test_a_cpu_rank_s_int8_work_is_charged_on_the_ring_that_runs_it_and_never_hides() -> None:
    """int8 on CPU ranks: an encode with error feedback per element and 2 (k-1)/k hops on a ring of k; cut by node,
    the node's 1/g across nodes; ZeRO-2/3 the reduce-scatter's (k-1)/k of each; exposed; nothing on GPUs."""
    from parallel.plan import codec_cpu_s

    cpu = Cluster(cores_per_node=4, devices_per_node=4, thread_speedup=4.0, int8_encode_ns=4.0, int8_hop_ns=1.0)
    int8, n = Training(batch=64, grad_bytes=4, wire_ratio=0.254, codec="int8"), 1e6
    lay = Layout(8, 1, 1, 1)  # 2 nodes of 4 ranks; core_share(8) = 4 / 4 = 1 core each
    assert codec_cpu_s(n, int8, cpu, lay, "flat") == pytest.approx(n * (4.0 + 2 * 7 / 8 * 1.0) * 1e-9)
    assert codec_cpu_s(n, int8, cpu, lay, "inter-node") == pytest.approx(n / 4 * (4.0 + 2 * 1 / 2 * 1.0) * 1e-9)
    assert codec_cpu_s(n, int8, cpu, replace(lay, zero=2), "flat") == pytest.approx(n * 7 / 8 * 5.0 * 1e-9)
    assert codec_cpu_s(n, replace(int8, codec="fp16"), cpu, lay, "flat") == 0.0
    assert codec_cpu_s(n, int8, replace(cpu, int8_encode_ns=0.0), lay, "flat") == 0.0
    model, flat = Transformer(4, 256, 4, 64, 256), replace(int8, compression_scope="flat")
    behind, exposed = dp_comm_s(model, flat, cpu, lay)
    uncharged = dp_comm_s(model, flat, replace(cpu, int8_encode_ns=0.0, int8_hop_ns=0.0), lay)
    assert (behind, exposed - uncharged[1]) == pytest.approx(
        (uncharged[0], codec_cpu_s(stage_params(model, lay), int8, cpu, lay, "flat")))


def test_the_testbed_is_one_core_per_host_and_links_at_the_shaped_rate_or_as_measured() -> None:
    bed = namespace_testbed(Cluster(cores_per_node=2, inter_alpha_us=50), "1gbit")
    assert (bed.devices_per_node, bed.cores_per_node, bed.inter_gbps) == (1, 1, 0.125)
    assert bed.link(2) == pytest.approx((50e-6, 0.125e9)) and bed.core_share(2) == 1.0
    measured = namespace_testbed(Cluster(cores_per_node=2), "1gbit", (1.2e-3, 0.12e9))
    assert measured.link(2) == pytest.approx((1.2e-3, 0.12e9))
    with pytest.raises(ConfigError, match="--testbed"):
        namespace_testbed(bed, "fast")


def test_cpu_ranks_share_the_cores_and_gpus_do_not() -> None:
    cpu = Cluster(cores_per_node=2, devices_per_node=64)
    assert [cpu.core_share(n) for n in (1, 2, 4, 8)] == [2.0, 1.0, 0.5, 0.25]
    assert [cpu.interpreter_share(n) for n in (1, 2, 4)] == [1.0, 1.0, 0.5]  # threads do not run Python faster
    assert Cluster().core_share(8) == 1.0 and Cluster().interpreter_share(8) == 1.0


def test_a_node_with_every_core_busy_computes_at_the_measured_speedup_shared_by_its_ranks() -> None:
    node = Cluster(cores_per_node=4, devices_per_node=64, thread_speedup=2.5)  # 4 busy cores: 2.5 cores' worth
    assert [node.core_share(n) for n in (1, 2, 4, 8)] == pytest.approx([2.5, 1.25, 0.625, 0.3125])
    model, train = Transformer(4, 128, 4, 64, 256), Training(batch=32, param_bytes=4, grad_bytes=4)
    lay = Layout(1, 1, 1, 1)
    linear, measured = replace(node, thread_speedup=0.0), replace(node, layer_overhead_us=500.0)
    ratio = estimate(model, train, node, lay).compute_s / estimate(model, train, linear, lay).compute_s
    assert ratio == pytest.approx(4 / 2.5)  # the kernels at 2.5 cores' rate, not 4
    # the fixed cost per layer runs on one thread: more threads leave it whole
    fixed = estimate(model, train, measured, lay).compute_s - estimate(model, train, node, lay).compute_s
    assert fixed == pytest.approx((4 + 1) * 500e-6)


def test_fixed_cost_and_rate_are_recovered_from_layer_timings() -> None:
    samples = [(flops, 3e-3 + flops / 40e9) for flops in (1e6, 5e7, 4e8)]
    fixed, rate = fit_overhead_and_rate(samples)
    assert fixed == pytest.approx(3e-3) and rate == pytest.approx(40e9)
    with pytest.raises(ValueError, match="two sizes"):
        fit_overhead_and_rate([(1e6, 1.0), (1e6, 2.0)])


def test_zero_stages_move_the_volume_zero_says() -> None:
    """Stage 1: all-reduce then all-gather the parameters (1.5x); 2: reduce-scatter and all-gather (1x); 3: gathers
    before forward and backward (1.5x); bandwidth only, so the volumes show as times."""
    cluster = Cluster(intra_alpha_us=0.0, intra_gbps=1.0)
    model = Transformer(4, 128, 4, 64, 256)
    train = replace(MIXED_ADAM, batch=8, param_bytes=4, grad_bytes=4)
    totals = [sum(dp_comm_s(model, train, cluster, Layout(4, 1, 1, 1, zero=z))) for z in range(4)]
    assert [t / totals[0] for t in totals] == pytest.approx([1.0, 1.5, 1.0, 1.5])


def markdown() -> str:
    """The validation table of docs/PLANNER.md."""
    lines = ["| params (B) | GPUs | published (dp, tp, pp) | published TFLOP/s/GPU | predicted | error | "
             "recommended (with recomputation) | its gain | fastest overall |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in validation():
        row, pub, rec, overall = case["row"], case["published"], case["recommended"], case["overall"]
        lay = pub.layout
        lines.append(
            f"| {row['params_billion']} | {row['gpus']} | ({lay.dp}, {lay.tp}, {lay.pp}) | {row['tflops_per_gpu']} | "
            f"{pub.tflops_per_gpu:.1f} | {pub.tflops_per_gpu / float(row['tflops_per_gpu']) - 1:+.1%} | "
            f"{rec.layout.label()} | {pub.step_s / rec.step_s - 1:+.1%} | "
            f"{overall.layout.label()} ({pub.step_s / overall.step_s - 1:+.1%}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown())


def test_repeated_runs_merge_into_the_median_of_their_medians() -> None:
    from jobs.bench.plan_check import merge_repeats

    runs = [{"label": "dp=2", "step_s": t, "steps_s": [t], "peak_bytes": b, "peaks_bytes": [b]}
            for t, b in ((0.126, 10), (0.108, 30), (0.181, 20))]
    merged = merge_repeats(runs)
    assert (merged["label"], merged["step_s"], merged["peak_bytes"]) == ("dp=2", 0.126, 30)
    assert merged["runs_step_s"] == [0.126, 0.108, 0.181] and merged["steps_s"] == [[0.126], [0.108], [0.181]]


def test_the_last_gradient_bucket_is_never_hidden_behind_backward() -> None:
    """One bucket (a model smaller than the bucket) starts reducing only when backward ends: all of it is exposed;
    many buckets hide all but the last one's share behind backward."""
    model, cluster = Transformer(4, 128, 4, 64, 256), Cluster(cores_per_node=2, inter_gbps=0.01, intra_gbps=0.01)
    lay = Layout(dp=2, tp=1, pp=1, microbatches=1)
    behind, _ = dp_comm_s(model, Training(batch=32), cluster, lay)
    no_overlap = estimate(model, Training(batch=32, dp_overlap=False), cluster, lay)
    one_bucket = estimate(model, Training(batch=32), cluster, lay)
    assert one_bucket.dp_s == pytest.approx(no_overlap.dp_s) == pytest.approx(behind)
    many = estimate(model, Training(batch=32, bucket_bytes=1e3), cluster, lay)
    assert many.dp_s < one_bucket.dp_s


@pytest.mark.slow
@pytest.mark.parametrize("testbed", [False, True])
def test_validate_runs_each_layout_in_rounds_and_compares(testbed: bool, capsys) -> None:
    import os
    import shutil

    if testbed and (os.geteuid() != 0 or not all(shutil.which(c) for c in ("ip", "tc", "nsenter"))):
        pytest.skip("the namespace testbed needs root, iproute2 and nsenter")
    where = ["--testbed", "1gbit"] if testbed else ["--launcher", "local"]
    layout = "2x2 dp=4 int8 cut" if testbed else "dp=2"  # the testbed's: 2 hosts (nodes) of 2 ranks
    rounds = 1 if testbed else 2  # rounds are the same machinery on both (tests/test_plan.py's suite time)
    argv = ["plan", str(GPT), "--validate", "--layouts", layout, "--steps", "3", "--warmup", "1", "--repeats",
            str(rounds), "--cluster", str(LOCAL_CLUSTER), "--json", *where]
    assert main(argv) == 0
    record = json.loads(capsys.readouterr().out)
    (row,) = record["rows"]
    assert row["label"] == layout and len(row["runs_step_s"]) == rounds and row["step_s"] in row["runs_step_s"]
    assert 0 < row["step_ratio"] < 10 and 0.5 < row["memory_ratio"] < 2
    if testbed:  # the link as measured across the testbed, not the rate it is shaped to; the loopback inside a host
        cluster, local = record["cluster"], load_cluster(LOCAL_CLUSTER)
        assert cluster["inter_gbps"] != 0.125 and 0.01 < cluster["inter_gbps"] < 0.2
        assert cluster["intra_gbps"] not in (local.intra_gbps, cluster["inter_gbps"]) and row["ranks_per_host"] == 2


def test_a_testbed_that_cannot_be_made_is_one_line_naming_why() -> None:
    """netns refuses the subnet before it makes anything: its own line, not a CalledProcessError's traceback."""
    from hpc.errors import HpcError
    from jobs.bench.plan_check import Testbed

    with pytest.raises(HpcError, match=r"^--testbed: the namespace testbed could not be made: .*subnet '10\.77\.999' "
                                       r"must be the first three octets of a /24"):
        with Testbed(2, "1gbit", prefix="hpcbad", subnet="10.77.999"):
            pass


MOE = Transformer(4, 128, 4, 64, 256, experts=8, top_k=2, moe_every=2)
MOE_TRAIN = Training(batch=32, dtype="fp32", act_bytes=4, param_bytes=4, grad_bytes=4, optimizer_bytes=8)


def test_experts_spread_over_ep_ranks_leave_each_rank_its_share_of_their_memory() -> None:
    """Each rank holds E/ep experts of each MoE layer: going from ep=1 to ep=4 frees 6 of 8 experts' states on each
    of the 2 MoE layers; the dense GPT it extends is the same model without them."""
    assert MOE.params - replace(MOE, experts=0).params == 2 * (7 * MOE.expert_params + 128 * 8)
    cluster = Cluster(cores_per_node=4)
    one, four = (memory_bytes(MOE, MOE_TRAIN, cluster, Layout(4, 1, 1, 1, ep=ep)) for ep in (1, 4))
    assert one - four == pytest.approx(2 * 6 * MOE.expert_params * (4 + 4 + 8))


def test_expert_parallelism_costs_four_all_to_alls_of_top_k_tokens_per_moe_layer_and_microbatch() -> None:
    cluster = Cluster(cores_per_node=4, intra_alpha_us=100, intra_gbps=1.0)
    link = cluster.link(4)
    assert estimate(MOE, MOE_TRAIN, cluster, Layout(4, 1, 1, 2)).ep_s == 0.0  # ep=1: every expert at home
    tokens = 32 // (4 * 2) * 64
    for top_k in (1, 2):
        model = replace(MOE, top_k=top_k)
        got = estimate(model, MOE_TRAIN, cluster, Layout(4, 1, 1, 2, ep=4)).ep_s
        assert got == pytest.approx(2 * 2 * 4 * all_to_all_s(tokens * top_k * 128 * 4, 4, link))


def test_layouts_try_every_ep_that_divides_dp_and_the_experts() -> None:
    eps = {lay.ep for lay in layouts(replace(MOE, experts=6), MOE_TRAIN, 4) if lay.dp == 4}
    assert eps == {1, 2}  # 4 does not divide 6 experts
    assert {lay.ep for lay in layouts(MOE, MOE_TRAIN, 4) if lay.dp == 2} == {1, 2}
    assert {lay.ep for lay in layouts(replace(MOE, experts=0), MOE_TRAIN, 4)} == {1}


def test_the_built_in_gpt_is_counted_as_built_its_head_its_own() -> None:
    """spec_gpt against jobs/models/gpt.py's GPT: Megatron's count (the planner's) has a bias on QKV, which ours has
    not, and leaves the final LayerNorm out; the head is a Linear of its own, not the embedding."""
    from hpc.config import load_spec
    from jobs.models.gpt import gpt
    from parallel.plan import spec_gpt

    for width in (128, 256):
        spec = load_spec(GPT, [f"model.d_model={width}"])
        m = spec.model
        built = sum(p.numel() for p in gpt(m.vocab_size, m.seq_len, m.d_model, m.n_heads, m.n_layers).parameters())
        assert spec_gpt(spec).params - built == m.n_layers * 3 * width - 2 * width


def test_plan_of_an_moe_spec_counts_experts_and_names_its_ep(capsys) -> None:
    spec = REPO / "jobs" / "examples" / "gpt_moe.toml"
    assert main(["plan", str(spec), "--cluster", str(LOCAL_CLUSTER), "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "2.71M-parameter GPT" in out and "8 experts top-2 every 2 layers" in out  # 2,711,552 built
    assert re.search(r"the spec's layout, dp=4 tp=1 pp=1 m=1 1f1b ep=4: number \d+ of", out), out


def test_the_plan_cuts_the_gradient_exchange_by_node_only_where_it_pays() -> None:
    """int8 across 2 nodes of 4: the node's 4 shards cross in parallel, each on its own link, uncompressed inside;
    one device a node, or inside one node, it is the flat ring; with links inside a node no faster than between
    nodes it does not pay, and auto keeps the flat ring."""
    from parallel.plan import gradient_exchange_s

    model, grads = Transformer(8, 1024, 16, 1024, 51200), 1e9
    cluster = replace(load_cluster("a100-superpod"), devices_per_node=4, intra_gbps=100.0, inter_gbps=1.0)
    int8, lay = Training(batch=64, grad_bytes=4, wire_ratio=0.254), Layout(8, 1, 1, 1)
    cut, scope = gradient_exchange_s(grads, int8, cluster, lay)
    flat, _ = gradient_exchange_s(grads, replace(int8, compression_scope="flat"), cluster, lay)
    inside, across = 2 * 3 / 4 * 4e9 / 100e9, 2 * 1 / 2 * 4e9 * 0.254 / 4 / 1e9  # the alphas are microseconds
    assert scope == "inter-node" and cut == pytest.approx(inside + across, rel=1e-3) and cut < flat / 3
    assert estimate(model, int8, cluster, lay).layout.label().endswith(" inter-node")
    assert gradient_exchange_s(grads, Training(batch=64, grad_bytes=4), cluster, lay)[1] == "flat"  # no codec
    assert gradient_exchange_s(grads, int8, replace(cluster, devices_per_node=1), lay) == (flat, "flat")
    assert gradient_exchange_s(grads, int8, cluster, Layout(4, 1, 1, 1))[1] == "flat"  # one node: nothing crosses
    slow_inside = replace(cluster, intra_gbps=0.2)
    assert gradient_exchange_s(grads, int8, slow_inside, lay)[1] == "flat"
    assert gradient_exchange_s(grads, replace(int8, compression_scope="inter-node"), slow_inside, lay)[1] == \
        "inter-node"


# make bench-gpu on an H200 (docs/BENCHMARKS.md): the 0.72B Llama of jobs/bench/llama_bench.toml, eager in session
# 17, compiled in session 22 (the compiled blocks on SDPA's flash kernel since)
MEASURED_GPU = {False: (0.2250, 39.5e9), True: (0.1453, 27.5e9)}  # train.compile -> (step s, peak bytes)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_llama_bench_step_and_memory_are_within_15_percent_of_the_gpu_rows(capsys, compiled) -> None:
    """Eager and compiled are planner inputs (train.compile; the cluster's eager terms, fitted to these two rows):
    step time and peak memory within 15% of what make bench-gpu measured."""
    spec = REPO / "jobs" / "bench" / "llama_bench.toml"
    assert main(["plan", str(spec), "--cluster", "h100-dgx", "--gpus", "1", "--layout", "dp=1,tp=1,pp=1,m=1",
                 "--set", f"train.compile={str(compiled).lower()}", "--json"]) == 0
    plan_json = json.loads(capsys.readouterr().out)
    predicted = plan_json["recommended"]
    assert predicted["layout"]["microbatches"] == 1 and plan_json["training"]["compiled"] is compiled
    step_s, peak = MEASURED_GPU[compiled]
    assert predicted["step_s"] == pytest.approx(step_s, rel=0.15)
    assert predicted["memory_bytes"] == pytest.approx(peak, rel=0.15)


# make bench-gpu on an H200, session 22: rows the planner was not fitted to (spec, overrides, checkpointing,
# measured step s and peak bytes, and a recorded miss of the step where there is one: predicted / measured). In
# session 21 the 128k row's step was one (0.68), its loss then taking logits to float32 32 rows at a time, 512
# chunks of small kernels the GPU waited on; with parallel/tensor_parallel.py's LOSS_CHUNK_ELEMENTS since, it is not.
HELD_OUT_GPU = [
    ("llama3b_bench.toml", ["train.compile=true"], "", 0.3382, 72.34e9, None),
    ("llama_bench.toml", ["train.compile=true", "model.args.vocab_size=128256", "model.args.tie_word_embeddings=true"],
     "full", 0.2790, 23.96e9, None),
]


@pytest.mark.parametrize("row", HELD_OUT_GPU, ids=["3.2b-compiled", "128k-recompute-compiled"])
def test_gpu_rows_the_planner_was_not_fitted_to_are_within_15_percent(row) -> None:
    from hpc.config import load_spec
    from jobs.models.shape import spec_model

    name, overrides, checkpointing, step_s, peak, step_miss = row
    spec = load_spec(REPO / "jobs" / "bench" / name, overrides)
    model = spec_model(spec)
    predicted = estimate(model, spec_training(spec, model.hidden), load_cluster("h100-dgx"),
                         Layout(1, 1, 1, 1, checkpointing=checkpointing))
    assert predicted.memory_bytes == pytest.approx(peak, rel=0.15)
    assert predicted.step_s / step_s == pytest.approx(step_miss or 1.0, abs=0.01 if step_miss else 0.15)


def test_a_tied_head_is_counted_once_on_one_stage_and_as_a_copy_on_the_last_of_a_pipeline() -> None:
    """Issue 43: under pp > 1 the last stage holds its own copy of a tied embedding (parallel/tied.py), with its
    gradient and optimizer state: as much as an untied head. On one stage the tensor is one."""
    tied, untied = Transformer(8, 1024, 16, 1024, 51200), Transformer(8, 1024, 16, 1024, 51200, tied=False)
    one, two = Layout(1, 2, 1, 1), Layout(1, 2, 2, 1)
    assert stage_params(untied, one) - stage_params(tied, one) == 51200 * 1024 / 2
    assert stage_params(tied, two) == stage_params(untied, two)
    cluster = load_cluster("h100-dgx")
    assert memory_bytes(tied, MIXED_ADAM, cluster, two) == memory_bytes(untied, MIXED_ADAM, cluster, two)


def test_compression_is_recommended_only_where_it_pays() -> None:
    """On NVLink nodes joined by 400 Gbit/s a GPT's DP exchange hides behind backward: no codec pays. Joined by
    10 Gbit/s it does not: int8 cut by node (the codec across nodes only) wins, at a layout with more DP than the
    uncompressed plan's, at least PAYS shorter."""
    from parallel.plan import PAYS, compression_advice

    model = Transformer(24, 2048, 16, 2048, 51200)
    train = replace(MIXED_ADAM, batch=256)
    fast = compression_advice(model, train, load_cluster("h100-dgx"), 32)
    assert (fast["codec"], fast["scope"], fast["step_s"]) == ("none", "flat", fast["uncompressed_step_s"])
    slow = compression_advice(model, train, Cluster(inter_gbps=1.25, inter_alpha_us=50), 32)
    assert (slow["codec"], slow["scope"]) == ("int8", "inter-node")
    assert slow["step_s"] <= (1 - PAYS) * slow["uncompressed_step_s"]
    assert slow["steps"]["int8 inter-node"] < slow["steps"]["int8 flat"] < slow["steps"]["none flat"]
