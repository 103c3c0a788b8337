"""ZeRO stages 1 and 2: sharded optimizer state (and gradients) train like one process; checkpoints cross dp and stage.

The reference is tests/test_3d.py's single-process run (10 steps of Adam, clipping active);
each sharded run must match its losses and parameters as every unsharded layout does there.
Each rank must also really hold only its share of Adam's state and, at stage 2, after the
step's reduction only its own parameters' gradients. A checkpoint saved by (dp=2, zero=1 or
2) loads under (dp=1, zero=0) with every state tensor exactly as saved, and the other way
round each rank takes exactly its own parameters' state; runs resumed either way end where
the uninterrupted run ends. The ring's reduce-scatter keeps the all-reduce's bookkeeping:
summed over ranks, what the owners hold plus the residuals is what was put in.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hpc.config import spec_from_dict, spec_to_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from tests.conftest import BOTH_BACKENDS
from tests.numerics import assert_trained_close
from tests.ranks import run_ranks
from tests.test_3d import LR, STEPS, _check_matches, assemble, gpt_spec, pieces_as_numpy
from tests.test_3d import single_process as single_process  # the fixture


def _spec(run_dir: str, name: str, layout, microbatches: int, zero: int, every: int = 0, resume: str = "never"):
    raw = spec_to_dict(gpt_spec(run_dir, name, layout, microbatches=microbatches))
    raw["parallel"]["zero"] = zero
    if zero == 3:  # several buckets (about 7 of the tiny GPT's 67k parameters), so gathers and prefetches interleave
        raw["parallel"]["bucket_mb"] = 0.04
    raw["checkpoint"] = {"every_steps": every, "resume": resume}
    return spec_from_dict(raw)


def _train(world, run_dir: str, cases):
    """Each case through the real trainer; returns per case this rank's pieces and its optimizer state's size."""
    import jobs.train.loop

    built, held = [], []
    build = jobs.train.loop.build_data_parallel_optimizer

    def build_and_watch(spec, model, *args, **kw):
        """Count, just before ZeRO-3 gives every rank the whole model back, the parameters with memory."""
        optimizer = build(spec, model, *args, **kw)
        unshard = optimizer.unshard
        optimizer.unshard = lambda: held.append(sum(
            p.numel() for p in model.parameters() if p.untyped_storage().nbytes())) or unshard()
        return built.append(optimizer) or optimizer

    jobs.train.loop.build_data_parallel_optimizer = build_and_watch
    results = []
    for name, layout, microbatches, zero, every, resume in cases:
        mesh = build_mesh(MeshShape(*layout), world.rank)
        _, model = jobs.train.loop.train(_spec(run_dir, name, layout, microbatches, zero, every, resume), world, mesh)
        optimizer = built[-1]
        state = sum(v.numel() for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
        coordinate = (mesh.index("tp"), mesh.index("pp"))
        grads = sum(p.grad.numel() for p in model.parameters() if p.grad is not None)  # as the last step left them
        only_owned = all((p.grad is not None) == optimizer.holds_gradient(p) for p in model.parameters())
        results.append((pieces_as_numpy(model, mesh), state, sum(p.numel() for p in model.parameters()), coordinate,
                        grads, only_owned, held[-1]))
    return results


def _check_sharded(single_process, run_dir: Path, cases, results) -> None:
    _check_matches(single_process, run_dir, [c[:1] for c in cases], [[c[0] for c in r] for r in results])
    for number, (name, _, _, zero, *_) in enumerate(cases):
        groups: dict[tuple[int, int], list] = {}  # the DP group of each (tp, pp) coordinate
        for per_rank in results:
            groups.setdefault(per_rank[number][3], []).append(per_rank[number])
        for group in groups.values():
            assert len(group) == 2 and group[0][2] == group[1][2], name
            params = group[0][2]
            shares = [case[1] for case in group]
            assert sum(shares) == 2 * params, (name, shares, params)  # Adam's two moments, each held once
            assert max(shares) <= 0.6 * 2 * params, (name, shares)  # and about half on each replica
            grads = [case[4] for case in group]
            assert all(case[5] for case in group), name  # a gradient exactly where this rank holds state
            if zero >= 2:  # each gradient held by one replica only after the reduction, about half on each
                assert sum(grads) == params and max(grads) <= 0.6 * params, (name, grads, params)
            else:
                assert grads == [params, params], (name, grads)
            kept = [case[6] for case in group]  # parameters with memory between steps
            if zero == 3:  # each held by its owner only, about half on each
                assert sum(kept) == params and max(kept) <= 0.6 * params, (name, kept, params)
            else:
                assert kept == [params, params], (name, kept)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_alone_and_with_tp_and_pp_trains_like_one_process(single_process, tmp_path, zero) -> None:
    two = [(f"zero{zero}-dp2", (2, 1, 1), 1, zero, 0, "never")]
    _check_sharded(single_process, tmp_path, two, run_ranks(2, _train, str(tmp_path), two, timeout=240))
    four = [(f"zero{zero}-dp2-tp2", (2, 2, 1), 1, zero, 0, "never"),
            (f"zero{zero}-dp2-pp2", (2, 1, 2), 2, zero, 0, "never")]  # two microbatches: accumulation
    _check_sharded(single_process, tmp_path, four, run_ranks(4, _train, str(tmp_path), four, timeout=240))


def _restored_state(world, step_dir: str, dp: int, zero: int):
    """A fresh (dp, zero) optimizer restored from ``step_dir``: {name/key: values} of the state this rank holds."""
    from jobs.models.protocol import build_model
    from jobs.train.checkpointing import restore
    from jobs.train.optim import build_optimizer
    from parallel.optimizer import distributed_optimizer
    from parallel.transport import make_transport

    spec = _spec("unused", "restore", (dp, 1, 1), 1, zero)
    mesh = build_mesh(MeshShape(dp, 1, 1), world.rank)
    model = build_model(spec)
    optimizer = distributed_optimizer(build_optimizer(spec.train, model.parameters()),
                                      make_transport("torch", mesh.group("dp")), zero=zero, module=model)
    assert restore(step_dir, world.rank, model, optimizer, mesh) == 5
    names = {id(p): name for name, p in model.named_parameters()}
    held = {f"{names[id(p)]}/{key}": value.numpy().copy()
            for p, s in optimizer.state.items() for key, value in s.items()}
    optimizer.close()
    return held


def _saved_state(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    optim = {name.removeprefix("optim/"): name for name in index.tensors if name.startswith("optim/")}
    for key, name in optim.items():  # each state tensor whole in the index, shaped like its parameter or a scalar
        shape = tuple(index.tensors[name].shape)
        assert shape in ((), tuple(index.tensors[f"model/{key.rsplit('/', 1)[0]}"].shape)), (name, shape)
    return {key: read_tensor(index, name).numpy() for key, name in optim.items()}


@pytest.mark.parametrize("zero", [1, 2])
def test_a_sharded_checkpoint_resumes_without_zero_and_back(tmp_path, zero) -> None:
    sharded = [("sharded", (2, 1, 1), 1, zero, 5, "never")]
    run_ranks(2, _train, str(tmp_path), sharded, timeout=240)
    plain = [("plain", (1, 1, 1), 1, 0, 5, "never")]
    run_ranks(1, _train, str(tmp_path), plain, timeout=240)
    for source, dp, stage in (("sharded", 1, 0), ("plain", 2, zero)):
        step5 = tmp_path / source / "checkpoints" / "step-00000005"
        saved, held = _saved_state(step5), run_ranks(dp, _restored_state, str(step5), dp, stage, timeout=120)
        assert sorted(k for h in held for k in h) == sorted(saved), source  # every tensor, held exactly once
        for key, value in ((k, v) for h in held for k, v in h.items()):
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{source}: {key}")
    resumed = [("resumed-plain", (1, 1, 1), 1, 0, 0, str(tmp_path / "sharded" / "checkpoints" / "step-00000005"))]
    (one,) = run_ranks(1, _train, str(tmp_path), resumed, timeout=240)[0]
    resumed2 = [("resumed-sharded", (2, 1, 1), 1, zero, 0, str(tmp_path / "plain" / "checkpoints" / "step-00000005"))]
    two = run_ranks(2, _train, str(tmp_path), resumed2, timeout=240)
    for got, source in ((assemble([one[0]]), "sharded"), (assemble([r[0][0] for r in two]), "plain")):
        expected = _final_params(tmp_path / source / "checkpoints" / "step-00000010")
        assert_trained_close(got, expected, optimizer="adam", lr=LR, steps=STEPS, name=f"from {source}")


def test_a_zero3_checkpoint_from_four_ranks_resumes_under_zero1_and_without_zero(tmp_path) -> None:
    """Saved by (dp=4, zero=3), each parameter by its owner alone: the index holds every tensor whole; (dp=2,
    zero=1) and (dp=1, zero=0) restore each state tensor exactly as saved, and resumed (as does (dp=2, zero=3),
    which loads into memory it frees after) end where the uninterrupted run ends."""
    run_ranks(4, _train, str(tmp_path), [("zero3", (4, 1, 1), 1, 3, 5, "never")], timeout=240)
    step5 = tmp_path / "zero3" / "checkpoints" / "step-00000005"
    saved = _saved_state(step5)
    assert _final_params(step5).keys() == {f"model/{key.rsplit('/', 1)[0]}" for key in saved}  # every parameter
    for dp, stage in ((2, 1), (1, 0)):
        held = run_ranks(dp, _restored_state, str(step5), dp, stage, timeout=120)
        assert sorted(k for h in held for k in h) == sorted(saved), (dp, stage)  # every tensor, held exactly once
        for key, value in ((k, v) for h in held for k, v in h.items()):
            np.testing.assert_array_equal(value, saved[key], err_msg=f"{(dp, stage)}: {key}")
    expected = _final_params(tmp_path / "zero3" / "checkpoints" / "step-00000010")
    two = [(f"resumed-zero{stage}", (2, 1, 1), 1, stage, 0, str(step5)) for stage in (1, 3)]
    (one,) = run_ranks(1, _train, str(tmp_path), [("resumed-plain", (1, 1, 1), 1, 0, 0, str(step5))])[0]
    per_rank = run_ranks(2, _train, str(tmp_path), two, timeout=240)
    for name, got in [("dp1", assemble([one[0]]))] + [(case[0], assemble([r[i][0] for r in per_rank]))
                                                       for i, case in enumerate(two)]:
        assert_trained_close(got, expected, optimizer="adam", lr=LR, steps=STEPS, name=name)


def _final_params(step_dir: Path) -> dict[str, np.ndarray]:
    from hpc.checkpoint import open_checkpoint, read_tensor

    index = open_checkpoint(step_dir)
    return {name: read_tensor(index, name).numpy() for name in index.tensors if name.startswith("model/")}


@pytest.mark.parametrize(("sizes", "ranks", "owners"), [
    ([10, 1, 7, 3, 3], 2, [0, 1, 1, 1, 0]),  # 10 | 7, 3 to the lighter, then a tie: the lower rank
    ([4, 4, 4, 4], 4, [0, 1, 2, 3]),
    ([5, 5], 3, [0, 1]),
])
def test_owners_are_assigned_largest_first_to_the_least_loaded(sizes, ranks, owners) -> None:
    from parallel.zero import assign_owners

    assert assign_owners(sizes, ranks) == owners


def _gather(world):
    import torch
    import torch.distributed as dist

    from parallel.zero import ZeroShards

    shapes = [((3,), torch.float32), ((5,), torch.float64), ((2, 2), torch.float32), ((4,), torch.float32)]
    params = [torch.full(shape, float(10 * world.rank + i), dtype=dtype) for i, (shape, dtype) in enumerate(shapes)]
    shards = ZeroShards(params, dist.group.WORLD)
    received = shards.gather_parameters()
    owners = [next(r for r, owned in enumerate(shards.by_owner) if any(p is q for q in owned)) for p in params]
    return [p.tolist() for p in params], owners, received


def test_each_owner_broadcasts_its_parameters_whatever_their_dtypes() -> None:
    results = run_ranks(2, _gather, timeout=60)
    owners = results[0][1]
    assert owners == [0, 0, 1, 1] and results[1][1] == owners  # 5 -> 0, 4 -> 1, 4 -> 1 (4 < 5), 3 -> 0 (5 < 8)
    expected = [np.full(shape, 10 * owner + i).tolist()
                for i, (shape, owner) in enumerate(zip([(3,), (5,), (2, 2), (4,)], owners, strict=True))]
    for rank, (values, _, received) in enumerate(results):
        assert values == expected, rank
        assert received == sum(4 * n if i != 1 else 8 * n for i, n in enumerate([3, 5, 4, 4]) if owners[i] != rank)


def _reduce_scatter_twice(world, name: str, numel: int):
    """Two steps of a ring codec's reduce-scatter with error feedback, through the reducer ZeRO-2 uses."""
    import torch

    from parallel.compression.registry import make_reducer
    from parallel.transport import TorchTransport
    from tests.test_ring import _inputs

    reducer, results, inputs = make_reducer(name), [], []
    for step in range(2):
        x = _inputs(world.rank + 10 * step, numel, torch.float32, integer=False) * 3
        owned, sent = reducer.reduce_scatter("bucket0", x.clone(), TorchTransport(), average=False)
        inputs.append(x.numpy())
        results.append(owned.numpy().copy())
    residual = reducer.state_dict().get("residual/bucket0.scatter", torch.zeros(numel)).numpy()
    return inputs, results, residual, sent


@pytest.mark.parametrize("name", ["none", "fp16", "int8"])
def test_the_reduce_scatter_keeps_the_rings_residual_bookkeeping(name) -> None:
    """Each rank ends with the full sum of chunk (rank + 1) % n; over two steps with error feedback, the owned
    results plus the residuals left add up to the inputs (sum of inputs = sum of results + residuals)."""
    import torch

    n, numel = 3, 5000
    outputs = run_ranks(n, _reduce_scatter_twice, name, numel)
    chunks = [c.numpy() for c in torch.arange(numel).tensor_split(n)]
    results = np.zeros(numel)
    for rank, (_, owned, _, sent) in enumerate(outputs):
        for step_result in owned:
            results[chunks[(rank + 1) % n]] += step_result
        assert sent < numel * 4 * (n - 1) / n * 1.01, (rank, sent)  # one phase: (n - 1)/n of the buffer at most
    inputs = sum(np.sum(o[0], axis=0, dtype=np.float64) for o in outputs)
    residuals = np.sum([o[2] for o in outputs], axis=0, dtype=np.float64)
    np.testing.assert_allclose(results + residuals, inputs, atol=1e-4)
    if name == "none":
        assert not residuals.any()
    else:  # the codec did lose something, and feedback carried it
        assert np.abs(residuals).max() > 0
        assert np.abs(results - inputs).max() < 0.1 * np.abs(inputs).max()


def _tiny_steps(world, name: str):
    """Three SGD steps of a small model at zero=2 with ``name`` compressing after one exact warm-up step."""
    import torch
    import torch.distributed as dist

    from parallel.optimizer import distributed_optimizer
    from parallel.transport import TorchTransport

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    optimizer = distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), TorchTransport(dist.group.WORLD),
                                      reducer=name, warmup_steps=1, zero=2, bucket_bytes=600)
    held = []
    for step in range(3):
        generator = torch.Generator().manual_seed(10 * step + world.rank)
        optimizer.zero_grad()
        model(torch.randn(8, 16, generator=generator)).square().mean().backward()
        optimizer.step()
        held.append(all((p.grad is not None) == optimizer.holds_gradient(p) for p in model.parameters()))
    optimizer.close()
    return [p.detach().numpy().copy() for p in model.parameters()], held, len(optimizer.buckets)


@pytest.mark.parametrize("name", ["int8", "topk"])  # powersgd takes the path top-k takes
def test_zero2_steps_after_the_compression_warm_up_with_every_kind_of_reducer(name) -> None:
    """Ring codecs reduce-scatter; top-k and PowerSGD all-reduce and drop others' gradients: either way,
    past the exact warm-up step, each rank keeps only its own gradients and the replicas stay identical."""
    (params0, held0, buckets), (params1, held1, _) = run_ranks(2, _tiny_steps, name, timeout=60)
    assert buckets > 1  # owners are assigned per bucket
    assert all(held0) and all(held1)
    for a, b in zip(params0, params1, strict=True):
        np.testing.assert_array_equal(a, b)


def _residual_of(reducer, shards, bucket, index: int) -> list:
    """Each of ``bucket``'s parameters' residual on this rank: top-k keeps one per tensor; a ring codec's
    reduce-scatter one per bucket, laid out by owner (chunk c: rank (c - 1) % n's parameters, padded)."""
    state = reducer.state_dict()
    if reducer.name == "topk":
        return [state[f"residual/bucket{index}/{i}"].reshape(p.shape).numpy() for i, p in enumerate(bucket)]
    flat, n = state[f"residual/bucket{index}.scatter"], shards.size
    shares = [[p for p in bucket if shards.owner(p) == (c - 1) % n] for c in range(n)]
    length, where = flat.numel() // n, {}
    for c, share in enumerate(shares):
        offset = c * length
        for p in share:
            where[id(p)] = flat[offset:offset + p.numel()].reshape(p.shape).numpy()
            offset += p.numel()
    return [where[id(p)] for p in bucket]


def _reduce_at_zero3(world, name: str):
    """Two steps' gradients (drawn, not computed) reduced by the ZeRO-3 optimizer with ``name``: per parameter,
    this rank's inputs, what it keeps (None: another rank owns it) and its residuals left after them."""
    import torch
    import torch.distributed as dist

    from parallel.optimizer import distributed_optimizer
    from parallel.transport import TorchTransport

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    optimizer = distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), TorchTransport(dist.group.WORLD),
                                      reducer=name, zero=3, module=model, bucket_bytes=4096, overlap=False)
    params, inputs, kept = list(model.parameters()), 0, 0
    for step in range(2):
        generator = torch.Generator().manual_seed(100 * step + world.rank)
        grads = [torch.randn(p.shape, generator=generator, dtype=torch.float64).float() * 3 for p in params]
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad.clone()
        optimizer.synchronize()
        inputs = inputs + np.concatenate([g.numpy().ravel() for g in grads])
        kept = kept + np.concatenate([(p.grad if p.grad is not None else torch.zeros_like(grad)).numpy().ravel()
                                      for p, grad in zip(params, grads, strict=True)])
        optimizer.zero_grad()
    residuals = {id(p): r for b in optimizer.buckets
                 for p, r in zip(b.params, _residual_of(optimizer.reducer, optimizer.zero, b.params, b.index),
                                 strict=True)}
    optimizer.close()
    return inputs, kept, np.concatenate([residuals[id(p)].ravel() for p in params]), len(optimizer.buckets)


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_zero3_reductions_keep_the_residual_bookkeeping(name) -> None:
    """int8 reduce-scatters to the owners, top-k all-reduces and the others drop: either way, summed over
    ranks and two steps, the inputs are the owners' kept gradients (means, so times n) plus the residuals."""
    n = 3
    outputs = run_ranks(n, _reduce_at_zero3, name, timeout=60)
    assert outputs[0][3] > 1  # several buckets, each with its owners
    inputs = np.sum([o[0] for o in outputs], axis=0, dtype=np.float64)
    kept = np.sum([o[1] for o in outputs], axis=0, dtype=np.float64) * n
    residuals = np.sum([o[2] for o in outputs], axis=0, dtype=np.float64)
    np.testing.assert_allclose(kept + residuals, inputs, atol=1e-4)
    assert np.abs(residuals).max() > 0.01  # the codec did drop something, and feedback kept it


def _bf16_accumulating_steps(world):
    """Four steps at zero 2 and then at zero 3 of a small model under bf16 autocast, two backward passes per step,
    int8 after one exact warm-up step, gradients clipped between synchronize() and step(); on ``world.device``.
    Also, at zero 3, the streams the gathers ran on: (the optimizer's communication stream's, each one's)."""
    import torch
    import torch.distributed as dist

    import parallel.zero
    from parallel.optimizer import distributed_optimizer
    from parallel.transport import TorchTransport

    device, gathered_on = world.device, []
    fill = parallel.zero._Unit.fill

    def watched_fill(unit, transport) -> None:
        gathered_on.append(torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
        fill(unit, transport)

    parallel.zero._Unit.fill = watched_fill
    results = []
    for zero in (2, 3):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                    torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
        optimizer = distributed_optimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                          TorchTransport(dist.group.WORLD), reducer="int8", warmup_steps=1, zero=zero,
                                          module=model, bucket_bytes=2000, backward_passes_per_step=2)
        for step in range(4):
            optimizer.zero_grad()
            for k in range(2):
                generator = torch.Generator().manual_seed(100 * step + 10 * k + world.rank)
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = model(torch.randn(8, 16, generator=generator).to(device))
                out.float().square().mean().backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 0.05)
            with optimizer.skip_synchronize():
                optimizer.step()
        held = sum(p.numel() for p in model.parameters() if p.untyped_storage().nbytes())
        comm = optimizer._stream.stream
        streams = (comm.cuda_stream if comm is not None else None, list(gathered_on))
        optimizer.unshard()
        optimizer.close()
        results.append(([p.detach().cpu().numpy().copy() for p in model.parameters()], held, len(optimizer.buckets)))
        gathered_on.clear()
    return results, streams


def test_zero3_steps_as_zero2_under_bf16_autocast_accumulation_the_warm_up_and_clipping() -> None:
    """Stage 3 changes where parameters live, not what is computed: bit for bit what stage 2 does, per rank."""
    for ((zero2, held2, _), (zero3, held3, buckets)), _ in run_ranks(2, _bf16_accumulating_steps, timeout=60):
        assert buckets > 2 and held3 < 0.6 * held2  # several buckets; about half the parameters kept
        for a, b in zip(zero2, zero3, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.cuda
def test_on_the_gpu_zero3_gathers_on_the_communication_stream_step_as_zero2() -> None:
    """Two ranks sharing the GPU: every gather ran on the optimizer's communication stream, and the compute
    stream's wait for each is enough: the parameters end where zero 2's do. A module that read a bucket before its
    gather ended would read zeros or the last step's values, a whole step (lr = 0.01) or the weight itself away;
    the tolerance is a tenth of a step, not bit for bit, as cuBLAS does not promise the CPU's determinism."""
    for ((zero2, _, _), (zero3, _, _)), (comm, streams) in run_ranks(2, _bf16_accumulating_steps, timeout=120,
                                                                       device="cuda"):
        assert comm is not None and streams and all(stream == comm for stream in streams)
        for a, b in zip(zero2, zero3, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)


def _stream_protocol(world):
    """Four ZeRO-3 steps with the optimizer's communication stream replaced by a recorder of its events: what
    each gather waited for, where it ran, and what the compute side waited for before using it."""
    import contextlib
    import threading

    import torch
    import torch.distributed as dist

    import parallel.optimizer
    import parallel.zero
    from parallel.transport import TorchTransport

    log, inside = [], threading.local()

    class RecordingStream:  # CommStream's interface; events are numbered tokens
        def __init__(self, device) -> None:
            self.recorded = 0

        def ready(self):
            self.recorded += 1
            event = (self.recorded, getattr(inside, "event", None) is not None)  # (number, on the comm stream)
            log.append(("record", event, threading.current_thread() is threading.main_thread()))
            return event

        @contextlib.contextmanager
        def after(self, event):
            inside.event = event
            try:
                yield
            finally:
                inside.event = None

        def join(self, event=None) -> None:
            log.append(("join", event, threading.current_thread() is threading.main_thread()))

        def release(self, tensor) -> None:
            on_main = threading.current_thread() is threading.main_thread()
            log.append(("release", getattr(inside, "event", None), on_main))

    fill = parallel.zero._Unit.fill

    def recorded_fill(unit, transport) -> None:
        log.append(("fill", getattr(inside, "event", None), threading.current_thread() is threading.main_thread()))
        fill(unit, transport)

    parallel.optimizer.CommStream, parallel.zero._Unit.fill = RecordingStream, recorded_fill
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    optimizer = parallel.optimizer.distributed_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), TorchTransport(dist.group.WORLD), zero=3, module=model,
        bucket_bytes=1200)
    for _ in range(4):
        optimizer.zero_grad()
        model(torch.randn(4, 16)).square().mean().backward()
        optimizer.step()
    optimizer.close()
    others = sum(1 for p in model.parameters() if not optimizer.zero.owns(p))
    return log, len(optimizer.buckets), others


@BOTH_BACKENDS
def test_zero3_gathers_run_on_the_communication_stream_after_an_event_and_compute_waits_for_each(backend) -> None:
    """On a GPU (here a recorder stands in for the stream): every gather on the communication stream runs inside
    ``after(event)``, that event recorded by the compute side before it asked, and the compute side joins the
    event recorded at the gather's end there, not the whole stream, before it goes on. Each gradient a rank
    drops (another rank owns it) is released to the communication stream, whose queued reduce-scatter still
    reads it, from inside ``after``: else the allocator would hand its memory to backward at once. Over Gloo the
    communication thread does that work; over NCCL (here its rules) the main thread issues it, in lockstep."""
    threaded = backend == "gloo"
    for log, buckets, others in run_ranks(2, _stream_protocol, timeout=60, backend=backend):
        assert buckets >= 3 and others > 0
        releases = [(after, on_main) for kind, after, on_main in log if kind == "release"]
        assert len(releases) == 4 * others
        assert all(after is not None and on_main != threaded for after, on_main in releases)
        fills = [i for i, (kind, _, _) in enumerate(log) if kind == "fill"]
        # every step: each bucket gathered for forward and again for backward, but the first, which stays
        assert len(fills) == 4 * (2 * buckets - 1)
        for i in fills:
            _, after, on_main = log[i]
            assert on_main != threaded and after is not None
            asked = next(j for j, entry in enumerate(log) if entry == ("record", after, True))
            assert asked < i  # recorded by the compute side, before the gather
            # the gather's end, recorded next on the communication stream, inside ``after``
            end = next(j for j in range(i + 1, len(log)) if log[j][0] == "record" and log[j][1][1])
            assert log[end][2] != threaded
            assert ("join", log[end][1], True) in log[end + 1:]  # which the compute side waited for
