"""DistributedOptimizer: fused buckets reduced during backward compute what one process computes."""

import time

import numpy as np
import pytest
import torch

from parallel.compression.registry import make_reducer
from parallel.optimizer import distributed_optimizer, make_buckets
from parallel.transport import TorchTransport
from tests.ranks import run_ranks

BATCH, FEATURES = 16, 32


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [torch.nn.Linear(FEATURES, FEATURES), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(FEATURES, 1))


def _batch(step: int, part: int | None = None, parts: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, FEATURES, generator=generator), torch.randn(BATCH, 1, generator=generator)
    if part is None:
        return x, y
    return x.chunk(parts)[part], y.chunk(parts)[part]


def _train(world, steps: int, bucket_bytes: int, passes: int, clip: float, overlap: bool, reducer: str = "none",
           views: bool = False):
    """Each rank trains on its slice of the batch (split again into ``passes`` micro-batches)."""
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = distributed_optimizer(
        base, TorchTransport(), named_parameters=model.named_parameters(), bucket_bytes=bucket_bytes,
        backward_passes_per_step=passes, overlap=overlap,
        reducer=make_reducer(reducer, topk_fraction=1.0) if reducer == "topk" else reducer, bucket_views=views,
    )
    parts = world.size * passes
    backward_ends, launches = [], []
    for step in range(steps):
        optimizer.zero_grad()
        for p in range(passes):
            x, y = _batch(step, world.rank * passes + p, parts)
            # mean over this micro-batch; averaging over ranks and summing passes / passes = the full-batch mean
            loss = torch.nn.functional.mse_loss(model(x), y) / passes
            loss.backward()
        backward_ends.append(time.perf_counter())
        optimizer.synchronize()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with optimizer.skip_synchronize():
            optimizer.step()
        launches.append(optimizer.stats.launch_times[0])
    stats = optimizer.stats
    buffers = {flat.untyped_storage().data_ptr() for flat in (optimizer._views.buffers if views else ())}
    in_buckets = [p.grad.untyped_storage().data_ptr() in buffers for p in model.parameters()]
    optimizer.close()
    first_launch_before_backward_end = all(a < b for a, b in zip(launches, backward_ends, strict=True))
    return (
        {k: v.detach().numpy() for k, v in model.state_dict().items()},
        stats.collectives,
        len(list(model.parameters())),
        first_launch_before_backward_end,
        isinstance(optimizer, torch.optim.SGD),
        all(in_buckets) == views,
    )


def _reference(steps: int, clip: float) -> dict:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        optimizer.zero_grad()
        x, y = _batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


# topk keeping every entry checks the momentum correction: momentum moved in front of the
# reduction (plain SGD after it) must be momentum SGD exactly.
# Bucket views: the gradients live in the buckets (reduced in place, accumulated into across passes).
@pytest.mark.parametrize(
    ("n", "passes", "clip", "overlap", "reducer", "views"),
    [(4, 1, 0.0, True, "none", False), (2, 2, 0.0, True, "none", True), (2, 1, 0.5, False, "none", False),
     (2, 1, 0.0, True, "topk", False), (2, 1, 0.0, True, "topk", True)],
)
def test_fused_overlapped_reduction_equals_one_process(n, passes, clip, overlap, reducer, views) -> None:
    steps, bucket_bytes = 5, 3 * FEATURES * FEATURES * 4  # a few layers per bucket
    expected = _reference(steps, clip)
    for params, collectives, num_params, launched_early, is_sgd, grads_in_buckets in run_ranks(
        n, _train, steps, bucket_bytes, passes, clip, overlap, reducer, views
    ):
        for name, value in expected.items():
            np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
        assert 1 < collectives < num_params  # fused: fewer collectives than parameters
        assert launched_early  # the first bucket's reduction started before backward ended
        assert is_sgd  # the wrapper is still the wrapped optimizer's class
        assert grads_in_buckets  # with views every gradient is a view of a bucket, without none is


def test_buckets_pack_greedily_and_never_split_a_parameter() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 10, 30, 5, 5)]
    buckets = make_buckets(params, bucket_bytes=80)  # 20 floats
    assert [[p.numel() for p in b.params] for b in buckets] == [[10, 10], [30], [5, 5]]


def _codec_running_sums(world, name: str, steps: int):
    """Running sums of the exact and the reduced gradient of a matrix, and this rank's residual for it."""
    reducer = make_reducer(name, topk_fraction=0.05, powersgd_rank=2)
    generator = torch.Generator().manual_seed(world.rank)
    exact_sum = torch.zeros(64, 48, dtype=torch.float64)
    reduced_sum = torch.zeros(64, 48, dtype=torch.float64)
    for _ in range(steps):
        grad = torch.randn(64, 48, generator=generator) * 0.01 + torch.linspace(-0.01, 0.01, 48)
        exact = grad.clone()
        torch.distributed.all_reduce(exact)
        exact_sum += exact.double()
        bias = torch.randn(48, generator=generator)
        reducer.reduce("b", [grad, bias], TorchTransport(), average=False)
        reduced_sum += grad.double()
    state = reducer.state_dict()
    return exact_sum.numpy(), reduced_sum.numpy(), state["residual/b/0"].double().view(64, 48).numpy(), sorted(state)


@pytest.mark.parametrize("name", ["topk", "powersgd"])
def test_error_feedback_loses_nothing_it_holds_back(name) -> None:
    """Sum of inputs = sum of reduced results + what the ranks still hold as residuals, at every step."""
    results = run_ranks(3, _codec_running_sums, name, 40)
    exact, reduced = results[0][0], results[0][1]
    held_back = sum(r[2] for r in results)
    assert np.abs(exact - reduced).max() > 1e-3  # the codec is lossy on this data
    np.testing.assert_allclose(reduced + held_back, exact, atol=1e-4)
    keys = results[0][3]
    if name == "powersgd":
        assert any(k.startswith("q/") for k in keys)  # the warm start is state a resume needs
