"""Mixture of experts: routing as pure functions, and expert parallelism training exactly like one process.

Every layout runs the real training loop for 10 steps of Adam with clipping, a tiny GPT
whose blocks 1 and 3 are MoE layers of 8 experts (top-2). With a capacity that drops
nothing, ep = 2 and 4, alone, with DP replicas of the experts, with TP and with PP,
must give the single process's losses (and parameters); with a small capacity, the
per-layer, per-expert kept counts of every step and the very choices kept in the last
step, sample by sample, must be the single process's too. A checkpoint saved at ep = 4
loads bit for bit at ep = 2 and ep = 1 and trains on like one process.

A launch costs seconds on 2 cores where 10 steps of this model cost a fraction of one, so
the tests of one world size share one launch (the module fixtures ``reference``,
``two_ranks``, ``four_ranks``, ``three_ranks``); a failure in one shows in each test using it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from hpc.config import spec_from_dict
from hpc.errors import ConfigError
from hpc.runtime.mesh import MeshShape, build_mesh, expert_group_ranks
from jobs.models.moe import assign_slots, capacity, load_balancing_loss, route
from tests.numerics import assert_trained_close
from tests.ranks import run_ranks, run_under_mpirun
from tests.test_3d import assemble, pieces_as_numpy

STEPS, LR, CLIP = 10, 3e-3, 0.5
EXPERTS, TOP_K, SEQ_LEN = 8, 2, 16
NO_DROP = EXPERTS / TOP_K  # capacity = seq_len: an expert can take every token of a sequence
TINY_MOE = {"kind": "gpt", "n_layers": 4, "n_heads": 2, "d_model": 16, "seq_len": SEQ_LEN,
            "moe_experts": EXPERTS, "moe_top_k": TOP_K, "moe_every": 2, "moe_z_loss_coef": 1e-3}
# Parameters: tests/numerics.py. Adam divides by each gradient's running RMS, so rounding differences between
# layouts (TP sums attention outputs in another order) become absolute update errors, largest for expert
# weights that few tokens reach; a wrong shard or a missing reduction moves most of a tensor by whole steps.


def moe_spec(run_dir: str, name: str, layout, capacity_factor: float = NO_DROP, steps: int = STEPS, **sections):
    dp, tp, pp, ep = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {**TINY_MOE, "moe_capacity_factor": capacity_factor},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": steps, "lr": LR, "optimizer": "adam", "grad_clip": CLIP, "log_every": 100,
                  **sections.get("train", {})},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, "ep": ep, "microbatches": 2 if pp > 1 else 1,
                     **sections.get("parallel", {})},
        "checkpoint": sections.get("checkpoint", {"every_steps": 0}),
    })


def _train(world, run_dir: str, cases):
    """Each case (name, (dp, tp, pp, ep), capacity factor, steps, checkpoint and train tables) trained; its
    pieces back."""
    from jobs.train.loop import train

    results = []
    for name, layout, factor, steps, checkpoint, options, parallel in cases:
        spec = moe_spec(run_dir, name, layout, factor, steps, checkpoint=checkpoint, train=options, parallel=parallel)
        mesh = build_mesh(MeshShape(*layout[:3]), world.rank)
        _, model = train(spec, world, mesh)
        results.append(pieces_as_numpy(model, mesh) + _kept_pieces(model, mesh))
    return results


def _kept_pieces(model, mesh) -> list[tuple[str, tuple, tuple, np.ndarray]]:
    """Which choices each MoE layer kept in the last training forward, as pieces of the global batch's mask
    (without pipeline microbatches: then the last forward is this replica's whole batch)."""
    from jobs.models.moe import moe_layers

    if mesh.index("tp") or mesh.size("pp") > 1:
        return []
    pieces = []
    for name, layer in moe_layers(model):
        if layer.last_kept is not None:
            kept = layer.last_kept.numpy().astype(np.float32)
            rows = len(kept)
            pieces.append((f"kept/{name}", (rows * mesh.size("dp"), *kept.shape[1:]),
                           (rows * mesh.index("dp"), 0, 0), kept))
    return pieces


def _misroute_one_token(at_call: int):
    """``jobs.models.moe.route`` that, at its ``at_call``-th call, sends the first token's first choice to an expert it
    did not choose: what an off-by-one in a dispatch or a wrong split does to one token."""
    import jobs.models.moe

    original, calls = jobs.models.moe.route, [0]

    def route(logits, top_k, slots):
        routing, probs = original(logits, top_k, slots)
        calls[0] += 1
        if calls[0] != at_call:
            return routing, probs
        expert = routing.expert.clone()
        expert[0, 0, 0] = next(e for e in range(logits.shape[-1]) if e not in expert[0, 0].tolist())
        return jobs.models.moe.Routing(expert, routing.gate, assign_slots(expert, logits.shape[-1], slots)), probs
    return route


def _drop_expert_gradient(at_backward: int):
    """``jobs.models.moe.run_experts`` that zeroes the first layer's expert 0's gradients at their ``at_backward``-th
    backward: what an expert gradient missing from its replicas' reduction does at one step."""
    import jobs.models.moe

    original, hooked = jobs.models.moe.run_experts, []

    def run_experts(x, counts, sizes, experts, *args):
        if not hooked:
            for param in experts[0].parameters():
                seen = [0]

                def drop(grad, seen=seen):
                    seen[0] += 1
                    return torch.zeros_like(grad) if seen[0] == at_backward else grad
                hooked.append(param.register_hook(drop))
        return original(x, counts, sizes, experts, *args)
    return run_experts


PLANTED = {"a token routed to the wrong expert at step 2": ("route", lambda: _misroute_one_token(at_call=3)),
           "an expert's gradient dropped at step 2": ("run_experts", lambda: _drop_expert_gradient(at_backward=2))}


def _train_planted(world, run_dir: str) -> list:
    """The single process once per planted bug: its pieces, each run."""
    import jobs.models.moe

    results = []
    for attribute, patched in PLANTED.values():
        original = getattr(jobs.models.moe, attribute)
        setattr(jobs.models.moe, attribute, patched())
        try:
            results.append(_train(world, run_dir, [_case(f"planted-{len(results)}", (1, 1, 1, 1))])[0])
        finally:
            setattr(jobs.models.moe, attribute, original)
    return results


def _weights(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {key: value for key, value in params.items() if not key.startswith("kept/")}


def _case(name, layout, factor=NO_DROP, steps=STEPS, checkpoint=None, parallel=None, **train):
    return name, layout, factor, steps, checkpoint or {"every_steps": 0}, train, parallel or {}


def _records(run_dir: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run_dir / name / "metrics.jsonl").open()]


def _several(world, calls):
    """Several tests' work on one set of ranks, in turn."""
    return [fn(world, *args) for fn, *args in calls]


def _launch(world_size: int, *calls, timeout: float = 300, starter=run_ranks) -> list[list]:
    """Each call ``(fn, *args)`` on ``world_size`` ranks, all in one launch (``starter``: run_ranks, or
    run_under_mpirun): on 2 cores, a launch costs seconds (forks, imports, rendezvous, first use) where 10 steps
    of the tiny model cost a fraction of one. Per call, its result on each rank."""
    per_rank = starter(world_size, _several, calls, timeout=timeout)
    return [[results[i] for results in per_rank] for i in range(len(calls))]


def _assembled(per_rank) -> list[dict[str, np.ndarray]]:
    """``_train``'s results from every rank: per case, the single-device tensors."""
    return [assemble([results[i] for results in per_rank]) for i in range(len(per_rank[0]))]


def _run(world_size: int, run_dir: Path, cases) -> list[dict[str, np.ndarray]]:
    return _assembled(_launch(world_size, (_train, str(run_dir), cases))[0])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The single process, without drops and with a small capacity (dropping about a fifth); and the user's
    model at ep=1 (``user``: its held-out evaluation)."""
    run_dir = tmp_path_factory.mktemp("single")
    trained, (user,), planted = _launch(1, (_train, str(run_dir), [_case("single", (1, 1, 1, 1)),
                                                                  _case("small", (1, 1, 1, 1), 0.5)]),
                                        (_train_user_model, str(run_dir), 1), (_train_planted, str(run_dir)))
    params = _assembled(trained)
    full, small = _records(run_dir, "single"), _records(run_dir, "small")
    assert [r["step"] for r in full] == list(range(1, STEPS + 1))
    assert full[-1]["loss"] < full[0]["loss"] - 0.3  # it learns
    assert max(r["grad_norm"] for r in full) > CLIP  # clipping is active
    assert all(r["moe_dropped_fraction"] == 0 for r in full)
    assert min(r["moe_dropped_fraction"] for r in small) > 0.05
    kept = params[1]["kept/blocks.1.mlp"]
    assert kept.shape == (8, SEQ_LEN, TOP_K) and 0 < kept.mean() < 1  # the small capacity drops some choices
    for record in full:
        loads = np.array(record["moe_tokens_per_expert"])  # [MoE layer, expert]
        assert loads.shape == (2, EXPERTS) and (loads.sum(1) == 8 * SEQ_LEN * TOP_K).all()
        assert record["moe_aux_loss"] >= 1.0  # Switch's loss is 1 at a perfectly even load, more otherwise
    return {"single": (full, params[0]), "small": (small, params[1]), "user": (run_dir, user),
            "planted": dict(zip(PLANTED, _assembled(planted), strict=True))}


def _check(reference, run_dir: Path, cases, params, which="single") -> None:
    ref_records, ref_params = reference[which]
    for (name, *_), got in zip(cases, params, strict=True):
        records = _records(run_dir, name)
        assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref_records], rel=1e-5), name
        assert [r["moe_tokens_per_expert"] for r in records] == [r["moe_tokens_per_expert"] for r in ref_records]
        assert [r["moe_aux_loss"] for r in records] == pytest.approx([r["moe_aux_loss"] for r in ref_records],
                                                                     rel=1e-5)
        assert_trained_close(_weights(got), _weights(ref_params), optimizer="adam", lr=LR, steps=STEPS, name=name)
        for key in got.keys() - _weights(got).keys():  # the very choices kept at step 10, sample by sample
            np.testing.assert_array_equal(got[key], ref_params[key], err_msg=f"{name}: {key}")


CHECKPOINT_AT = 5
FOUR_RANKS = [  # (dp, tp, pp, ep)
    _case("ep4", (4, 1, 1, 4), checkpoint={"every_steps": CHECKPOINT_AT}),  # saved for the resumes at ep2, ep1
    _case("ep2-dp2", (4, 1, 1, 2)),  # two replicas of each expert
    _case("ep2-tp2", (2, 2, 1, 2)),
    _case("ep2-pp2", (2, 1, 2, 2)),
    _case("ep4-small", (4, 1, 1, 4), 0.5),
]
EIGHT_RANKS = [
    _case("ep4-dp2", (8, 1, 1, 4)),
    _case("ep4-tp2", (4, 2, 1, 4)),
    _case("ep4-pp2", (4, 1, 2, 4)),
]
TWO_RANKS = [
    _case("ep2", (2, 1, 1, 2)),
    _case("ep2-recompute", (2, 1, 1, 2), activation_checkpointing=True),
    _case("ep2-small", (2, 1, 1, 2), 0.5),
]


def _resume_cases(ep: int, step_dir: Path):
    """Loaded only (``steps`` = the checkpoint's step), and resumed to the end."""
    resume = {"every_steps": 0, "resume": str(step_dir)}
    layout = (ep, 1, 1, ep)
    return [_case(f"ep{ep}-load", layout, steps=CHECKPOINT_AT, checkpoint=resume),
            _case(f"ep{ep}-resume", layout, checkpoint=resume)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    """FOUR_RANKS trained: the run directory and each case's tensors."""
    run_dir = tmp_path_factory.mktemp("four")
    return run_dir, _run(4, run_dir, FOUR_RANKS)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, four_ranks):
    """Every 2-rank test's work in one launch: TWO_RANKS, the ep4 checkpoint loaded and resumed at ep2, the user's
    model at ep2, the int8 checkpoint resumed under another ep."""
    run_dir = tmp_path_factory.mktemp("two")
    cases = TWO_RANKS + _resume_cases(2, _ep4_checkpoint(four_ranks))
    trained, user, int8 = _launch(2, (_train, str(run_dir), cases), (_train_user_model, str(run_dir), 2),
                                  (_resume_int8_under_another_ep, str(run_dir)))
    return {"run_dir": run_dir, "params": dict(zip([name for name, *_ in cases], _assembled(trained), strict=True)),
            "user": user, "int8": int8}


def _ep4_checkpoint(four_ranks) -> Path:
    return four_ranks[0] / "ep4" / "checkpoints" / f"step-{CHECKPOINT_AT:08d}"


def test_ep2_alone_trains_like_one_process(reference, two_ranks) -> None:
    run_dir, params = two_ranks["run_dir"], [two_ranks["params"][name] for name, *_ in TWO_RANKS]
    _check(reference, run_dir, TWO_RANKS[:2], params[:2])  # recomputed blocks: the same, their routing counted once
    _check(reference, run_dir, TWO_RANKS[2:], params[2:], "small")  # the same choices dropped, step after step


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_routing_or_expert_gradient_bug_fails_the_parameter_check(reference, bug) -> None:
    """The parameters alone (as tests/numerics.py bounds them, outliers in whole units allowed) catch a bug
    that touches one token or one expert at one step."""
    _, ref_params = reference["single"]
    with pytest.raises(AssertionError, match="experts"):
        assert_trained_close(_weights(reference["planted"][bug]), _weights(ref_params), optimizer="adam", lr=LR,
                             steps=STEPS, name=bug)


def test_ep_with_dp_tp_and_pp_on_four_ranks_trains_like_one_process(reference, four_ranks) -> None:
    run_dir, params = four_ranks
    _check(reference, run_dir, FOUR_RANKS[:-1], params[:-1])
    _check(reference, run_dir, FOUR_RANKS[-1:], params[-1:], "small")


def test_ep4_with_dp_tp_and_pp_on_eight_ranks_trains_like_one_process(reference, tmp_path) -> None:
    params = _run(8, tmp_path, EIGHT_RANKS)
    _check(reference, tmp_path, EIGHT_RANKS, params)


def test_a_checkpoint_saved_at_ep4_resumes_at_ep2_and_ep1(reference, four_ranks, two_ranks, tmp_path) -> None:
    from hpc.checkpoint.load import open_checkpoint, read_tensor

    index = open_checkpoint(_ep4_checkpoint(four_ranks))
    assert index.attrs["layout_ep"] == 4
    saved = {name: read_tensor(index, name).numpy() for name in index.tensors if name.startswith("model/")}
    assert any(".experts.7." in key for key in saved)
    loaded_at = {2: (two_ranks["run_dir"], two_ranks["params"]["ep2-load"], two_ranks["params"]["ep2-resume"])}
    loaded_at[1] = (tmp_path, *_run(1, tmp_path, _resume_cases(1, _ep4_checkpoint(four_ranks))))
    ref_records, ref_params = reference["single"]
    for ep, (run_dir, loaded, resumed) in loaded_at.items():
        assert loaded.keys() == saved.keys()
        for key, expected in saved.items():
            np.testing.assert_array_equal(loaded[key], expected, err_msg=f"ep{ep}: {key}")  # bit for bit
        records = _records(run_dir, f"ep{ep}-resume")
        assert [r["step"] for r in records] == list(range(CHECKPOINT_AT + 1, STEPS + 1))
        assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref_records[CHECKPOINT_AT:]],
                                                             rel=1e-5)
        assert_trained_close(_weights(resumed), _weights(ref_params), optimizer="adam", lr=LR, steps=STEPS,
                             name=f"ep{ep}")


# --- pure functions ---------------------------------------------------------------------------


def test_slots_go_first_choices_first_then_token_order() -> None:
    # sequence of 3 tokens, top-2; expert 1 gets token 2's first choice, token 0's second, then is full
    expert = torch.tensor([[[0, 1], [0, 1], [1, 0]]])
    assert assign_slots(expert, 2, 2).tolist() == [[[True, True], [True, False], [True, False]]]
    assert assign_slots(expert, 2, 3).all()
    assert capacity(16, 8, 2, 4.0) == 16 and capacity(16, 8, 2, 0.5) == 2 and capacity(3, 8, 1, 0.1) == 1


def test_routing_is_per_sequence_so_any_split_of_the_batch_drops_the_same_choices() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 16, 8, generator=generator)
    whole, _ = route(logits, 2, capacity(16, 8, 2, 0.5))
    parts = [route(part, 2, capacity(16, 8, 2, 0.5))[0] for part in logits.split([1, 2, 3])]
    assert torch.equal(torch.cat([p.kept for p in parts]), whole.kept)
    assert torch.equal(torch.cat([p.expert for p in parts]), whole.expert)
    assert 0 < int((~whole.kept).sum()) < whole.kept.numel()
    assert torch.allclose(whole.gate.sum(-1), torch.ones(6, 16))  # top-2 gates renormalized


def test_the_load_balancing_loss_is_one_when_even_and_grows_with_imbalance() -> None:
    even = torch.full((1, 4, 4), 0.25)
    assert load_balancing_loss(even, torch.tensor([[0, 1, 2, 3]])).item() == pytest.approx(1.0)
    skewed = torch.tensor([[[0.7, 0.1, 0.1, 0.1]] * 4])
    assert load_balancing_loss(skewed, torch.zeros(1, 4, dtype=torch.long)).item() == pytest.approx(2.8)


def test_expert_groups_are_carved_out_of_each_dp_group() -> None:
    ep_groups, replicas = expert_group_ranks(MeshShape(4, 2, 1), 2)  # ranks: tp + 2 * dp
    assert ep_groups == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert replicas == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert expert_group_ranks(MeshShape(2, 1, 2), 2) == ([(0, 1), (2, 3)], [(0,), (1,), (2,), (3,)])


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parallel": {"ep": 2}}, "parallel.ep must be a divisor of model.moe_experts=0"),
    ({"parallel": {"ep": 3, "dp": 3}, "model": {"kind": "gpt", "moe_experts": 8}},
     "parallel.ep must be a divisor of model.moe_"),
    ({"parallel": {"ep": 2, "dp": 3}, "model": {"kind": "gpt", "moe_experts": 8}},
     "parallel.ep must be a divisor of dp=3"),
    ({"parallel": {"ep": 2, "zero": 1}, "model": {"kind": "gpt", "moe_experts": 8}},
     "parallel.ep must be 1 under parallel.zero"),
    ({"model": {"kind": "gpt", "moe_experts": 1, "moe_top_k": 2}}, "model.moe_top_k must be at most moe_experts=1"),
    ({"model": {"kind": "gpt", "moe_experts": 4, "moe_top_k": 3}}, "model.moe_top_k must be <= 2"),
    ({"model": {"moe_experts": 4}}, "model.moe_experts must be 0 for model.kind='mlp'"),
    ({"model": {"entry": "m:f", "moe_experts": 4}}, "model.moe_experts must be 0 with model.entry"),
])
def test_moe_settings_that_disagree_are_one_error_naming_the_field(overrides, message) -> None:
    with pytest.raises(ConfigError, match=f"^<spec>: {message}"):
        spec_from_dict(overrides)


@pytest.fixture(scope="module")
def three_ranks():
    """One launch of 3 ranks: the exchange in both modes, then the bench."""
    sizes_first, padded, bench = _launch(3, (_exchange, None), (_exchange, 5), (_bench,), timeout=60)
    return {None: sizes_first, 5: padded, "bench": bench}


@pytest.mark.parametrize("max_rows", [None, 5], ids=["sizes-first", "padded-one-round"])
def test_all_to_all_with_uneven_splits_and_its_backward(three_ranks, max_rows) -> None:
    _check_exchange(three_ranks[max_rows])


def _check_exchange(results) -> None:
    n = len(results)
    for rank, (received, recv, grad) in enumerate(results):
        assert recv == [rank + 1 + source for source in range(n)]  # rank s sends s + d + 1 rows to rank d
        assert received == [float(100 * source + rank) for source in range(n) for _ in range(rank + 1 + source)]
        assert grad == [float(dest) for dest in range(n) for _ in range(rank + dest + 1)]  # d(rows to d) = d


def _exchange(world, max_rows, transport="torch"):
    import torch.distributed as dist

    from parallel.ep import all_to_all
    from parallel.transport import make_transport

    rank, n = dist.get_rank(), dist.get_world_size()
    send = [rank + dest + 1 for dest in range(n)]
    x = torch.cat([torch.full((k,), float(100 * rank + dest)) for dest, k in enumerate(send)]).requires_grad_()
    over = make_transport(transport, dist.group.WORLD) if transport != "torch" else None
    received, recv = all_to_all(x.unsqueeze(1), send, dist.group.WORLD, max_rows, over)
    weights = torch.cat([torch.full((k,), float(rank)) for k in recv])  # rows from source s weighted by me
    (received.squeeze(1) * weights).sum().backward()
    return received.squeeze(1).tolist(), recv, x.grad.tolist()


MPI_CASES = [_case("ep2-mpi", (2, 1, 1, 2), parallel={"transport": "mpi"}),
             _case("ep2-small-mpi", (2, 1, 1, 2), 0.5, parallel={"transport": "mpi"})]


def test_ep_over_the_mpi_transport_exchanges_and_trains_like_one_process(reference, tmp_path) -> None:
    """parallel.transport = "mpi" carries EP's exchanges as mpi4py point-to-point messages (ranks started by
    mpirun): the same rows, gradients, losses, choices kept and parameters as one process; and the bench's row."""
    trained, sizes_first, padded, bench = _launch(
        2, (_train, str(tmp_path), MPI_CASES), (_exchange, None, "mpi"), (_exchange, 5, "mpi"),
        (_bench, ("torch", "mpi")), starter=run_under_mpirun)
    _check_exchange(sizes_first)
    _check_exchange(padded)
    params = _assembled(trained)
    _check(reference, tmp_path, MPI_CASES[:1], params[:1])
    _check(reference, tmp_path, MPI_CASES[1:], params[1:], "small")
    assert [r["impl"] for r in bench[0]] == ["ours", "ours-mpi", "torch", "torch+copies", "torch-single"]


def test_expert_parallel_placement_holds_a_contiguous_share() -> None:
    from parallel.ep import ExpertPlacement

    placement = ExpertPlacement(8, None, 2, 4)
    assert [e for e in range(8) if placement.holds(e)] == [4, 5] and placement.local == 2


def test_the_alltoall_bench_times_ours_against_torch_on_the_same_rows(three_ranks) -> None:
    from jobs.bench.alltoall import format_table, uneven_splits

    assert uneven_splits(10, 0, 3) == [1, 3, 6] and sum(uneven_splits(1000, 2, 4)) == 1000
    rows = three_ranks["bench"][0]  # the bench checks that ours receives what torch-single does
    assert [r["impl"] for r in rows] == ["ours", "torch", "torch+copies", "torch-single"]
    assert all(r["time_s"] > 0 and r["ranks"] == 3 and r["bytes"] == 1 << 16 for r in rows)
    assert rows[1]["speed_vs_torch"] == 1.0 and "speed vs torch" in format_table(rows)


def _bench(world, transports=("torch",)):
    import torch.distributed as dist

    from jobs.bench.alltoall import bench_alltoall

    return bench_alltoall(dist.group.WORLD, [1 << 16], iters=2, warmup=1, transports=transports)


def test_the_report_sums_each_experts_load_over_the_steps() -> None:
    from hpc.observe.report import moe_rows

    steps = [{"step": 1, "moe_tokens_per_expert": [[1, 2], [3, 4]], "moe_dropped_fraction": 0.1, "moe_aux_loss": 1.5},
             {"step": 2, "moe_tokens_per_expert": [[10, 20], [30, 40]], "moe_dropped_fraction": 0.3,
              "moe_aux_loss": 1.25}]
    assert moe_rows(steps) == [("MoE layer 0: tokens per expert, all steps", "11 22"),
                               ("MoE layer 1: tokens per expert, all steps", "33 44"),
                               ("MoE: routed choices dropped (mean over steps)", "20.00%"),
                               ("MoE: load-balancing loss, first / last step", "1.5 / 1.25")]
    assert moe_rows([{"step": 1, "loss": 2.0}]) == []  # a dense run: no rows


def test_the_moe_example_shards_8_experts_over_4_ranks(capsys) -> None:
    from hpc.cli.main import main
    from hpc.config import load_spec
    from jobs.train.layout import check_layout

    example = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "gpt_moe.toml"
    spec = load_spec(example)
    assert check_layout(spec, 4).dp == 4 and spec.parallel.ep == 4 and spec.model.moe_experts == 8
    assert main(["run", "-n", "4", "--launcher", "local", "--dry-run", str(example)]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 4


def tiny_moe():
    """A user's model (``model.entry``) with an MoE layer: the digits as 8 tokens of 8 pixels."""
    from torch import nn

    from jobs.models.moe import MoE

    class TinyMoE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(8, 16), nn.Linear(128, 10)
            self.moe = MoE(16, 4, lambda: nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)), top_k=2,
                           capacity_factor=1.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x.view(-1, 8, 8))
            return self.head((h + self.moe(h)).flatten(1))

        def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(output, targets)

    return TinyMoE()


def digits_one_held_out():
    """The digits with a single held-out image: fewer than the DP ranks, so one rank has none to evaluate."""
    from torch.utils.data import TensorDataset

    from jobs.data.datasets import DataSplits, digits

    splits = digits()
    inputs, targets = splits.held_out.tensors
    return DataSplits(splits.train, TensorDataset(inputs[:1], targets[:1]))


def _train_user_model(world, run_dir: str, ep: int):
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"run_dir": run_dir, "name": f"user-ep{ep}", "seed": 3}, "model": {"entry": "tests.test_moe:tiny_moe"},
        "data": {"batch_size": 16, "entry": "tests.test_moe:digits_one_held_out"},
        "train": {"steps": STEPS, "lr": 1e-2, "optimizer": "adam", "log_every": 100},
        "parallel": {"dp": world.size, "ep": ep},
    })
    result, _ = train(spec, world, build_mesh(MeshShape(world.size, 1, 1), world.rank))
    return result.evaluation


def test_a_users_model_with_an_moe_layer_trains_under_ep_like_one_process(reference, two_ranks) -> None:
    """Also evaluates on one held-out sample: the DP rank without one still takes part in its EP group's
    all-to-alls (else its peer waits for it forever)."""
    one_dir, single = reference["user"]
    evaluations = two_ranks["user"]
    one, two = _records(one_dir, "user-ep1"), _records(two_ranks["run_dir"], "user-ep2")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["moe_tokens_per_expert"] for r in two] == [r["moe_tokens_per_expert"] for r in one]
    assert one[-1]["loss"] < one[0]["loss"] and 0 < one[0]["moe_dropped_fraction"] < 0.5
    assert single.keys() == {"held_out_loss"}
    for evaluation in evaluations:  # the one sample's loss, on every rank
        assert evaluation == pytest.approx(single, rel=1e-5)


class RecordedHeldOut:
    """Five held-out digits that record how many samples each fetch asks for (evaluation's forwards)."""

    fetches: ClassVar[list[int]] = []

    def __init__(self) -> None:
        from jobs.data.datasets import digits

        self.inputs, self.targets = (tensor[:5] for tensor in digits().held_out.tensors)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]

    def __getitems__(self, indices):
        RecordedHeldOut.fetches.append(len(indices))
        return [self[i] for i in indices]


def digits_five_recorded():
    from jobs.data.datasets import DataSplits, digits

    return DataSplits(digits().train, RecordedHeldOut())


def _evaluated(world, run_dir: str, ep: int) -> tuple[dict, list[int]]:
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"run_dir": run_dir, "name": f"eval-ep{ep}", "seed": 3}, "model": {"entry": "tests.test_moe:tiny_moe"},
        "data": {"batch_size": 4, "entry": "tests.test_moe:digits_five_recorded"},
        "train": {"steps": 2, "lr": 1e-2, "optimizer": "adam", "log_every": 100},
        "parallel": {"dp": world.size, "ep": ep},
    })
    result, _ = train(spec, world, build_mesh(MeshShape(world.size, 1, 1), world.rank))
    return result.evaluation, RecordedHeldOut.fetches


def test_evaluation_runs_in_training_sized_forwards_and_ep_peers_run_as_many(tmp_path) -> None:
    """One process evaluates its 5 held-out samples in forwards of a training microbatch (4, then 1); at dp=2 ep=2
    (microbatches of 2) the replicas hold 3 and 2 samples, and both run two forwards (2 + 1; 2 + one uncounted
    sample) so that their experts' all-to-alls pair, under NCCL's rules; the held-out loss is one process's."""
    from tests.nccl_rules import BACKEND as NCCL_RULES

    ((single, one_fetches),) = run_ranks(1, _evaluated, str(tmp_path), 1)
    two = run_ranks(2, _evaluated, str(tmp_path), 2, backend=NCCL_RULES)
    assert one_fetches == [4, 1]
    assert [fetches for _, fetches in two] == [[2, 1], [2, 1]]
    for evaluation, _ in two:
        assert evaluation == pytest.approx(single, rel=1e-5)


def _resume_int8_under_another_ep(world, run_dir: str):
    """Save at dp=2, ep=2 with int8 (residuals of the dense buckets only: the experts are outside the DP
    optimizer), restore into fresh optimizers at ep=2 and at ep=1 (whose buckets hold the experts too): the
    communication state each keeps; then train on at ep=1."""
    from hpc.observe.probe import Probe
    from jobs.train.checkpointing import restore
    from jobs.train.loop import build_data_parallel_optimizer, train
    from jobs.train.workloads import Workload

    mesh = build_mesh(MeshShape(2, 1, 1), world.rank)
    root = Path(run_dir) / "ckpt"
    int8 = {"compression": "int8"}
    train(moe_spec(run_dir, "int8-ep2", (2, 1, 1, 2), steps=2, checkpoint={"every_steps": 2, "dir": str(root)},
                   parallel=int8), world, mesh)
    resume = {"every_steps": 0, "resume": str(root / "step-00000002")}
    comm = {}
    for ep in (2, 1):
        spec = moe_spec(run_dir, f"int8-ep{ep}-resume", (2, 1, 1, ep), steps=3, checkpoint=resume, parallel=int8)
        workload = Workload(spec, mesh)
        optimizer = build_data_parallel_optimizer(spec, workload.model, mesh, Probe(), exclude=workload.expert_params)
        assert restore(resume["resume"], world.rank, workload.model, optimizer, mesh, ep=ep) == 2
        comm[ep] = {key: value.tolist() if key == "steps_synchronized" else tuple(value.shape)
                    for key, value in optimizer.comm_state_dict().items()}
        optimizer.close()
    result, _ = train(spec, world, mesh)  # ep=1 trains on from the ep=2 checkpoint
    return comm, result.start_step, result.final_loss


def test_a_change_of_ep_restores_no_codec_residuals_of_other_buckets(two_ranks) -> None:
    """At ep=2 the experts are outside the DP optimizer, at ep=1 inside: bucket 0 is another set of
    parameters, so like a change of dp, a change of ep drops the per-rank communication state."""
    for comm, start_step, final_loss in two_ranks["int8"]:
        assert comm[2]["steps_synchronized"] == 2 and any(key.startswith("residual/") for key in comm[2])  # kept
        assert comm[1] == {"steps_synchronized": 2}  # another layout: only the shared step count
        assert start_step == 2 and np.isfinite(final_loss)


def test_a_compiled_block_runs_its_moe_dispatch_eagerly_and_never_recompiles() -> None:
    """``train.compile`` compiles each block: the MoE dispatch, sized by the counts read on the host, stays
    eager, so a new routing (new sizes) reuses the block's graphs instead of recompiling them until Dynamo
    gives up on the block."""
    import torch._dynamo

    from jobs.models.moe import MoE

    torch._dynamo.reset()
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.LayerNorm(16), MoE(16, 4, lambda: torch.nn.Linear(16, 16), top_k=2))
    compiled, sizes = torch.compile(block, backend="eager"), set()
    for step in range(6):
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(step))
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            y = compiled(x)
        y.square().mean().backward()
        sizes.add(tuple(block[1].stats.tokens.tolist()))
        block[1].stats.reset()
        torch.testing.assert_close(y, block(x), rtol=0, atol=0)  # the graphs compute what the module does
        block[1].stats.reset()
    assert len(sizes) == 6  # each step's experts took other numbers of rows
