"""The project's real code under NCCL's rules (tests/nccl_rules.py): every parallel path trains as one process.

First the harness itself: each rule it enforces fails a program that breaks it (a program Gloo runs without
complaint), naming what every rank waits for. Then the GPT, the MoE GPT and the transformers Llama train
under it (DP, TP, PP with every schedule, ZeRO 0-3, EP, every codec, freeze and the masked loss, save and
resume): no hang, no message matched to the wrong receive, no two ranks entering different collectives, and
the same training as one process.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.nccl_rules import BACKEND, STALL_S
from tests.numerics import LOSS_RTOL, assert_trained_close
from tests.ranks import RankError, run_ranks
from tests.test_3d import LR, STEPS, TINY_GPT, _check_matches, _metrics, assemble, pieces_as_numpy, single_process

__all__ = ["single_process"]  # the fixture, shared with tests/test_3d.py


def _under_rules(n: int, fn, *args, timeout: float = 120):
    return run_ranks(n, fn, *args, timeout=timeout, backend=BACKEND)


def _failure(n: int, fn, *args) -> str:
    """What the ranks raised (the harness's message, from whichever rank reported first)."""
    with pytest.raises(RankError) as info:
        _under_rules(n, fn, *args, timeout=60)
    return str(info.value)


# --- the rules -------------------------------------------------------------------------------


def _different_collectives(world):
    if world.rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(4), src=0)


def test_ranks_entering_different_collectives_are_named() -> None:
    message = _failure(2, _different_collectives)
    assert "entered different collectives" in message
    assert "rank 0: all_reduce [((4,), 'float32')] SUM" in message and "rank 1: broadcast" in message


def _shapes_differ(world):
    dist.all_reduce(torch.ones(4 + world.rank))


def test_an_all_reduce_of_other_shapes_is_named() -> None:
    assert "rank 1: all_reduce [((5,), 'float32')]" in _failure(2, _shapes_differ)


def _what_gloo_has_no_call_for(world):
    """What NCCL moves and Gloo has no call for: a message of no bytes (a ring's chunk of a short bucket),
    all-gathers coalesced into one group (torch.compile's), and an all-to-all of lists (pieces of other sizes)."""
    import torch.distributed._functional_collectives as funcol

    peer = 1 - world.rank
    nothing = torch.empty(0)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.empty(0), peer),
                                        dist.P2POp(dist.irecv, nothing, peer)]):
        work.wait()
    pieces = [torch.full((2,), float(world.rank)), torch.full((3,), 10.0 + world.rank)]
    gathered = funcol.all_gather_into_tensor_coalesced(pieces, dist.group.WORLD)
    # rank r sends r + 1 + i values of 100r + i to rank i
    sent = [torch.full((world.rank + 1 + i,), 100.0 * world.rank + i) for i in range(2)]
    arrived = [torch.empty(r + 1 + world.rank) for r in range(2)]
    dist.all_to_all(arrived, sent)
    return nothing.numel(), [funcol.wait_tensor(t).tolist() for t in gathered], [t.tolist() for t in arrived]


def test_empty_messages_coalesced_all_gathers_and_lists_all_to_all_move_as_on_nccl() -> None:
    for rank, (received, gathered, arrived) in enumerate(_under_rules(2, _what_gloo_has_no_call_for)):
        assert received == 0
        assert gathered == [[0.0, 0.0, 1.0, 1.0], [10.0, 10.0, 10.0, 11.0, 11.0, 11.0]]
        assert arrived == [[float(100 * r + rank)] * (r + 1 + rank) for r in range(2)]


def _both_send_first(world):
    """Each rank's send, then its receive, in two batches: Gloo buffers the sends; NCCL waits for receives."""
    peer = 1 - world.rank
    dist.isend(torch.ones(3), peer).wait()
    dist.irecv(torch.empty(3), peer).wait()


def test_a_send_waits_for_its_receive_and_both_sending_first_is_a_named_deadlock() -> None:
    started = time.monotonic()
    message = _failure(2, _both_send_first)
    assert "deadlock under NCCL's rules" in message
    assert "rank 0 waits in group [0, 1] batch of send to 1" in message and "for ranks [1]" in message
    assert time.monotonic() - started < 3 * STALL_S + 20


def _tags_crossed(world):
    """Rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first: Gloo matches by tag, NCCL in order."""
    if world.rank == 0:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(2), 1, tag=1),
                                            dist.P2POp(dist.isend, torch.zeros(2), 1, tag=2)]):
            work.wait()
    else:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.empty(2), 0, tag=2),
                                            dist.P2POp(dist.irecv, torch.empty(2), 0, tag=1)]):
            work.wait()


def test_messages_received_in_another_order_than_sent_are_named() -> None:
    message = _failure(2, _tags_crossed)
    assert "met a receive posted for tag 2: NCCL matches messages in order, not by tag" in message


def _two_threads_in_two_orders(world):
    """Two communicators of the same two ranks; rank 0 issues A then B, rank 1 B then A (as two host threads
    racing would): fine where each communicator runs on its own, a deadlock on one queue per rank."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    first, second = (a, b) if world.rank == 0 else (b, a)
    works = []
    thread = threading.Thread(target=lambda: works.append(dist.all_reduce(torch.ones(2), group=first,
                                                                          async_op=True)))
    thread.start()
    thread.join()
    works.append(dist.all_reduce(torch.ones(2), group=second, async_op=True))
    for work in works:
        work.wait()


def test_work_issued_in_two_orders_by_two_threads_is_a_named_deadlock() -> None:
    message = _failure(2, _two_threads_in_two_orders)
    assert "deadlock under NCCL's rules" in message
    assert "all_reduce #0" in message and "for ranks [1]" in message and "for ranks [0]" in message


def _skip_one_tp_all_reduce(world):
    mesh = build_mesh(MeshShape(dp=1, tp=2, pp=1), world.rank)
    dist.all_reduce(torch.ones(2), group=mesh.group("tp"))
    if world.rank == 0:
        dist.all_reduce(torch.ones(2), group=mesh.group("tp"))


def test_a_rank_that_skips_a_tp_all_reduce_is_named_as_gone() -> None:
    message = _failure(2, _skip_one_tp_all_reduce)
    assert "rank 0 waits in group [0, 1] all_reduce #1" in message and "rank 1 has left" in message


# --- the GPT -----------------------------------------------------------------------------------


def _what_zero_issues(world, run_dir: str):
    """Per case, what the DP group carried, and whether the code took its NCCL paths (a transport in lockstep,
    reductions issued on the thread that runs backward)."""
    from jobs.train.loop import train
    from parallel.optimizer import InlineExecutor
    from parallel.transport import TorchTransport

    seen, inline, original = [], [], InlineExecutor.submit
    InlineExecutor.submit = lambda self, *args, **kwargs: inline.append(1) or original(self, *args, **kwargs)
    try:
        for zero in (2, 3):
            mesh = build_mesh(MeshShape(2, 1, 1), world.rank)
            spec = _gpt_spec(run_dir, f"zero{zero}", (2, 1, 1), {"zero": zero}, {"steps": 2}, {}, {})
            lockstep = TorchTransport(mesh.group("dp")).in_lockstep(torch.device("cpu"))
            inline.clear()
            train(spec, world, mesh)
            seen.append((lockstep, bool(inline), dict(mesh.group("dp").issued)))
    finally:
        InlineExecutor.submit = original
    return seen


def test_uncompressed_zero_buckets_go_through_nccls_own_collectives_issued_by_one_thread(tmp_path) -> None:
    """Issue 39's hazards 4 and 5: no reduction from a second host thread, no point-to-point ring for a bucket
    NCCL's reduce-scatter (ZeRO-2) or all-gather (ZeRO-3) moves."""
    (lockstep2, inline2, zero2), (lockstep3, inline3, zero3) = _under_rules(2, _what_zero_issues, str(tmp_path))[0]
    assert lockstep2 and lockstep3 and inline2 and inline3
    assert "point-to-point" not in zero2 and "point-to-point" not in zero3, (zero2, zero3)
    assert zero2["reduce_scatter_tensor"] >= 2 and zero3["all_gather_into_tensor"] >= 2, (zero2, zero3)


def _gpt_spec(run_dir: str, name: str, layout, parallel: dict, train: dict, checkpoint: dict, model: dict):
    dp, tp, pp = layout
    return spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {**TINY_GPT, **model},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": STEPS, "lr": LR, "optimizer": "adam", "grad_clip": 0.5, "log_every": 100, **train},
        "parallel": {"dp": dp, "tp": tp, "pp": pp, **parallel},
        "checkpoint": {"every_steps": 0, **checkpoint},
    })


def _train_gpt(world, run_dir: str, cases):
    """Each case (name, (dp, tp, pp), parallel, train and checkpoint tables) trained; this rank's pieces."""
    from jobs.train.loop import train

    results = []
    for name, layout, parallel, options, checkpoint in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank, timeout_s=60)
        _, model = train(_gpt_spec(run_dir, name, layout, parallel, options, checkpoint, {}), world, mesh)
        results.append(pieces_as_numpy(model, mesh))
    return results


def _case(name, layout, checkpoint=None, train=None, **parallel):
    return name, layout, parallel, train or {}, checkpoint or {}


TWO = [
    _case("dp2", (2, 1, 1)),
    _case("tp2", (1, 2, 1)),
    _case("pp2-gpipe-m2", (1, 1, 2), schedule="gpipe", microbatches=2),
    _case("pp2-1f1b-m8", (1, 1, 2), schedule="1f1b", microbatches=8),
    _case("pp2-interleaved-m2", (1, 1, 2), schedule="interleaved", microbatches=2, virtual_stages=2),
    _case("pp2-interleaved-m8", (1, 1, 2), schedule="interleaved", microbatches=8, virtual_stages=2),
    _case("dp2-zero1", (2, 1, 1), zero=1),
    _case("dp2-zero2", (2, 1, 1), zero=2),
    _case("dp2-zero3", (2, 1, 1), zero=3),
    _case("dp2-saved", (2, 1, 1), checkpoint={"every_steps": 5}),
]
SMALL_BUCKETS = 0.002  # MiB: several DP buckets reduced while backward still runs TP's all-reduces
FOUR = [
    _case("dp2-tp2", (2, 2, 1), bucket_mb=SMALL_BUCKETS),
    _case("dp2-tp2-zero2", (2, 2, 1), zero=2, bucket_mb=SMALL_BUCKETS),
    _case("dp2-pp2-interleaved-m4", (2, 1, 2), schedule="interleaved", microbatches=4, virtual_stages=2),
    _case("tp2-pp2-1f1b-m4", (1, 2, 2), schedule="1f1b", microbatches=4),
    _case("pp4-1f1b-m8", (1, 1, 4), schedule="1f1b", microbatches=8),
    _case("pp4-gpipe-m4", (1, 1, 4), schedule="gpipe", microbatches=4),
    _case("dp4-zero2", (4, 1, 1), zero=2),
    _case("dp2-tp2-zero3", (2, 2, 1), zero=3, bucket_mb=SMALL_BUCKETS),
    _case("dp2-pp2-zero1", (2, 1, 2), zero=1, microbatches=2),
]
CODECS = [_case(f"dp2-{codec}", (2, 1, 1), compression=codec)
          for codec in ("fp16", "bf16", "int8", "topk", "powersgd")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank GPT case under the rules, one launch; the codecs also over Gloo (their reference)."""
    run_dir = tmp_path_factory.mktemp("rules-two")
    resumed = _case("dp2-resumed", (2, 1, 1), checkpoint={"resume": str(run_dir / "dp2-saved" / "checkpoints" /
                                                                      "step-00000005")})
    trained = _under_rules(2, _train_gpt, str(run_dir), TWO + CODECS + [resumed], timeout=600)
    gloo_dir = tmp_path_factory.mktemp("gloo-codecs")
    run_ranks(2, _train_gpt, str(gloo_dir), CODECS, timeout=300)
    return run_dir, trained, gloo_dir


def test_every_two_rank_layout_trains_under_nccls_rules_like_one_process(single_process, two_ranks) -> None:
    run_dir, trained, _ = two_ranks
    cases = [(name,) for name, *_ in TWO]
    _check_matches(single_process, run_dir, cases, [per_rank[:len(TWO)] for per_rank in trained])


def test_codecs_move_under_nccls_rules_the_bytes_they_move_over_gloo(two_ranks) -> None:
    """The ring in lockstep (NCCL's) sends what the pipelined ring (Gloo's) sends: the same losses."""
    run_dir, _, gloo_dir = two_ranks
    for name, *_ in CODECS:
        assert _metrics(run_dir, name)[0] == pytest.approx(_metrics(gloo_dir, name)[0], rel=LOSS_RTOL), name


def test_a_checkpoint_saved_under_nccls_rules_resumes_to_one_process(single_process, two_ranks) -> None:
    run_dir, trained, _ = two_ranks
    ref_losses, _, ref_params = single_process
    assert _losses_from(run_dir / "dp2-resumed") == pytest.approx(ref_losses[5:], rel=LOSS_RTOL)
    params = assemble([per_rank[-1] for per_rank in trained])
    assert_trained_close(params, ref_params, optimizer="adam", lr=LR, steps=STEPS, name="dp2-resumed")


def _losses_from(run: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").open()]


def test_every_four_rank_layout_trains_under_nccls_rules_like_one_process(single_process, tmp_path) -> None:
    trained = _under_rules(4, _train_gpt, str(tmp_path), FOUR, timeout=600)
    _check_matches(single_process, tmp_path, [(name,) for name, *_ in FOUR], trained)


def _train_deeper(world, run_dir: str, cases, layers: int):
    """``_train_gpt`` on a GPT of ``layers`` blocks (4 stages of 2 chunks, or 2 of 3)."""
    from jobs.train.loop import train

    results = []
    for name, layout, parallel, options, checkpoint in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank, timeout_s=60)
        spec = _gpt_spec(run_dir, name, layout, parallel, options, checkpoint, {"n_layers": layers})
        results.append(pieces_as_numpy(train(spec, world, mesh)[1], mesh))
    return results


@pytest.mark.parametrize(("stages", "virtual", "layers"), [(4, 2, 8), (2, 3, 6)], ids=["p4-v2", "p2-v3"])
def test_interleaved_with_more_microbatches_than_stages_trains_like_one_process(tmp_path, stages, virtual,
                                                                              layers) -> None:
    """Issue 39's hazard 1: m = 2p deadlocked every rank on a cluster (the batch of 8 sequences allows m <= 8)."""
    cases = [_case(f"pp{stages}-v{virtual}-m{m}", (1, 1, stages), schedule="interleaved", microbatches=m,
                   virtual_stages=virtual) for m in sorted({stages, 2 * stages, 4 * stages}) if m <= 8]
    ref = assemble(run_ranks(1, _train_deeper, str(tmp_path), [_case("single", (1, 1, 1))], layers,
                             timeout=120)[0])
    trained = _under_rules(stages, _train_deeper, str(tmp_path), cases, layers, timeout=600)
    for number, (name, *_) in enumerate(cases):
        assert _losses_from(tmp_path / name) == pytest.approx(_losses_from(tmp_path / "single"), rel=LOSS_RTOL)
        params = assemble([per_rank[number] for per_rank in trained])
        assert_trained_close(params, ref, optimizer="adam", lr=LR, steps=STEPS, name=name)


@pytest.mark.slow
def test_eight_rank_layouts_train_under_nccls_rules_like_one_process(single_process, tmp_path) -> None:
    cases = [_case("dp2-tp2-pp2-interleaved-m4", (2, 2, 2), schedule="interleaved", microbatches=4,
                   virtual_stages=2),
             _case("dp4-pp2-1f1b-m2", (4, 1, 2), schedule="1f1b", microbatches=2),
             _case("dp2-tp2-pp2-zero2", (2, 2, 2), zero=2, microbatches=2)]
    trained = _under_rules(8, _train_gpt, str(tmp_path), cases, timeout=900)
    _check_matches(single_process, tmp_path, [(name,) for name, *_ in cases], trained)


def test_a_fine_tune_with_the_masked_loss_and_frozen_embeddings_trains_under_nccls_rules(tmp_path) -> None:
    """Targets marked -100 and ``train.freeze``: the global mean over counted targets, the embedding untouched,
    under DP x TP and TP x PP as one process."""
    from tests.test_finetune import _losses
    from tests.test_finetune import _train as train_finetune

    frozen = {"train": {"freeze": ["embedding.*"]}}
    cases = [("dp2-tp2", (2, 2, 1), 1, frozen), ("tp2-pp2", (1, 2, 2), 2, frozen)]
    ref = assemble(run_ranks(1, train_finetune, str(tmp_path), [("single", (1, 1, 1), 1, frozen)], timeout=120)[0])
    trained = _under_rules(4, train_finetune, str(tmp_path), cases, timeout=600)
    for number, (name, *_) in enumerate(cases):
        assert _losses(tmp_path, name) == pytest.approx(_losses(tmp_path, "single"), rel=LOSS_RTOL), name
        params = assemble([per_rank[number] for per_rank in trained])
        assert_trained_close(params, ref, optimizer="adam", lr=LR, steps=4, name=name)


# --- the MoE GPT and the transformers Llama --------------------------------------------------------


def test_experts_train_under_nccls_rules_like_one_process(tmp_path) -> None:
    from tests.test_moe import _assembled, _weights
    from tests.test_moe import _case as moe_case
    from tests.test_moe import _train as train_moe

    cases = [moe_case("ep2-tp2", (2, 2, 1, 2)), moe_case("ep2-pp2", (2, 1, 2, 2)), moe_case("ep4", (4, 1, 1, 4))]
    single = [moe_case("single", (1, 1, 1, 1))]
    ref = _assembled(run_ranks(1, train_moe, str(tmp_path), single, timeout=120))[0]
    got = _assembled(_under_rules(4, train_moe, str(tmp_path), cases, timeout=600))
    ref_losses = _losses_from(tmp_path / "single")
    for (name, *_), params in zip(cases, got, strict=True):
        assert _losses_from(tmp_path / name) == pytest.approx(ref_losses, rel=LOSS_RTOL), name
        assert_trained_close(_weights(params), _weights(ref), optimizer="adam", lr=3e-3, steps=STEPS, name=name)


def test_the_llama_trains_under_nccls_rules_like_one_process(tmp_path) -> None:
    from tests.test_hf import _train_llama

    cases = [("tp2-pp2", (1, 2, 2), {"microbatches": 2}), ("dp2-tp2", (2, 2, 1), {})]
    ref = assemble(run_ranks(1, _train_llama, str(tmp_path), [("single", (1, 1, 1), {})], timeout=120)[0])
    got = _under_rules(4, _train_llama, str(tmp_path), cases, timeout=600)
    for number, (name, *_) in enumerate(cases):
        assert _losses_from(tmp_path / name) == pytest.approx(_losses_from(tmp_path / "single"), rel=LOSS_RTOL)
        params = assemble([per_rank[number] for per_rank in got])
        assert_trained_close(params, ref, optimizer="adam", lr=LR, steps=STEPS, name=name)
        assert np.isfinite(sum(float(np.abs(v).sum()) for v in params.values()))


def test_a_tied_llama_trains_under_nccls_rules_like_one_process(tmp_path) -> None:
    """Tied embeddings under pp = 2: the embedding group's all-reduce after the DP reduction (ZeRO-2's owners
    among them), issued in one order on every rank with TP's and the pipeline's collectives."""
    from tests.test_tied import _train_tied

    cases = [("tied-tp2-pp2", (1, 2, 2), {"microbatches": 2}),
             ("tied-dp2-pp2-zero2", (2, 1, 2), {"microbatches": 2, "zero": 2})]
    (((single, _),),) = run_ranks(1, _train_tied, str(tmp_path), [("single", (1, 1, 1), {})], timeout=120)
    ref = assemble([single])
    got = _under_rules(4, _train_tied, str(tmp_path), cases, timeout=600)
    for number, (name, *_) in enumerate(cases):
        assert _losses_from(tmp_path / name) == pytest.approx(_losses_from(tmp_path / "single"), rel=LOSS_RTOL)
        params = assemble([per_rank[number][0] for per_rank in got])
        assert_trained_close(params, ref, optimizer="adam", lr=LR, steps=STEPS, name=name)
        holders = [per_rank[number][1] for per_rank in got if per_rank[number][1][0] is not None]
        assert len(holders) == 4 and all(all(checks) for checks in holders), name  # copies bitwise equal
