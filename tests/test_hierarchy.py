"""The hierarchical gradient exchange (parallel/hierarchy.py): exact where the flat all-reduce is, the flat ring
itself at one rank a node, no codec inside one node, error feedback per shard resumed bit for bit, and the GPT
trained on 2 "nodes" x 2 ranks under Gloo and under NCCL's rules. Ranks pretend to sit on nodes through the
node ranks ``build_mesh`` is given, as a launcher gives them."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hpc.config import spec_from_dict
from hpc.runtime.mesh import MeshShape, build_mesh
from hpc.runtime.placement import moves_with_nccl
from parallel.hierarchy import HierarchicalReducer, build_node_groups, dp_nodes, resolve_scope, split_by_node
from tests.conftest import BOTH_BACKENDS
from tests.nccl_rules import BACKEND as NCCL_RULES
from tests.ranks import run_ranks

SIZES = (1, 7, 1000, 4099)  # odd sizes: padded to a multiple of the node's ranks


def test_a_dp_group_is_cut_into_node_groups_and_the_ranks_holding_the_same_shard() -> None:
    assert split_by_node((0, 1, 2, 3), [0, 0, 1, 1]) == ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    assert split_by_node((0, 2, 4, 6), [0, 0, 0, 0, 1, 1, 1, 1]) == ([(0, 2), (4, 6)], [(0, 4), (2, 6)])
    assert split_by_node((0, 1), [0, 1]) == ([(0,), (1,)], [(0, 1)])  # one rank a node: the flat ring
    assert split_by_node((0, 1, 2), [0, 0, 0]) == ([(0, 1, 2)], [(0,), (1,), (2,)])  # one node: nothing crosses
    with pytest.raises(ValueError, match=r"different numbers of ranks on its nodes \(node 0: 3, node 1: 1\)"):
        split_by_node((0, 1, 2, 3), [0, 0, 0, 1])


def test_auto_cuts_by_node_only_where_a_codec_crosses_several_nodes() -> None:
    assert resolve_scope("auto", "int8", 2) == "inter-node"
    assert resolve_scope("auto", "int8", 1) == resolve_scope("auto", "none", 4) == "flat"
    assert resolve_scope("inter-node", "none", 1) == "inter-node" and resolve_scope("flat", "int8", 4) == "flat"


@pytest.mark.parametrize(("backend", "device", "native"),
                         [("cpu:gloo,cuda:nccl", "cuda", True), ("cpu:gloo,cuda:nccl", "cpu", False),
                          ("gloo", "cuda", False), ("nccl", "cuda", True), (NCCL_RULES, "cpu", True)])
def test_the_node_stages_are_the_backends_own_where_nccl_or_its_rules_carry_the_tensors(monkeypatch, backend, device,
                                                                                       native) -> None:
    """A GPU job's host tensors go through Gloo (the node's shared memory then); the CPU harness takes NCCL's path."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert moves_with_nccl(None, torch.device(device)) is native


def _mesh(world, per_node: int):
    return build_mesh(MeshShape(world.size, 1, 1), world.rank, world.device, node_rank=world.rank // per_node)


def _inputs(rank: int, numel: int, integer: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * rank + numel)
    if integer:
        return torch.randint(-50, 50, (numel,), generator=generator).float()
    return torch.randn(numel, generator=generator)


def _exact_against_the_flat_all_reduce(world, per_node: int) -> list:
    """Mismatches of the uncompressed hierarchical exchange against dist.all_reduce: bit for bit on integers
    (any order sums them exactly), within n roundings of sum |x| on floats; averaging too."""
    from parallel.compression.registry import make_reducer

    mesh = _mesh(world, per_node)
    reducer = HierarchicalReducer(make_reducer("none"), build_node_groups(mesh))
    wrong = []
    for numel in SIZES:
        for integer in (True, False):
            for average in (False, True):
                x = _inputs(world.rank, numel, integer)
                ours, theirs, magnitude = x.clone(), x.clone(), x.abs()
                reducer.reduce(f"b{numel}", [ours], None, average)
                for tensor in (theirs, magnitude):
                    dist.all_reduce(tensor)
                if average:
                    theirs /= world.size
                if integer and not average:
                    same = torch.equal(ours, theirs)
                else:
                    same = bool(torch.all((ours - theirs).abs() <= world.size * torch.finfo().eps * magnitude))
                if not same:
                    wrong.append((numel, integer, average))
    return wrong


@BOTH_BACKENDS
@pytest.mark.parametrize("per_node", [2, 1, 4])
def test_the_uncompressed_exchange_sums_as_the_flat_all_reduce(per_node, backend) -> None:
    """Under NCCL's rules the node's stages are the backend's own reduce-scatter and all-gather, as on a GPU."""
    assert run_ranks(4, _exact_against_the_flat_all_reduce, per_node, backend=backend) == [[]] * 4


def _scattered_against_the_sums(world, nodes: tuple[int, ...], codec: str) -> list:
    """ZeRO's reduce-scatter cut by node: each rank's reduced chunk (the flat ring's layout: rank r's in chunk
    r + 1) against the group's sum of that chunk; integers, so any order sums them exactly. Mismatches."""
    from parallel.compression.registry import make_reducer

    mesh = build_mesh(MeshShape(world.size, 1, 1), world.rank, node_rank=nodes[world.rank])
    reducer = HierarchicalReducer(make_reducer(codec), build_node_groups(mesh))
    assert reducer.supports_reduce_scatter
    wrong = []
    for chunk in (1, 5, 300):
        for average in (False, True):
            x = _inputs(world.rank, world.size * chunk, integer=True)
            total = x.clone()
            dist.all_reduce(total)
            owned, sent = reducer.reduce_scatter(f"b{chunk}", x.clone(), None, average)
            expected = total.view(world.size, -1)[(world.rank + 1) % world.size] / (world.size if average else 1)
            if not torch.equal(owned, expected) or sent <= 0:
                wrong.append((chunk, average))
    return wrong


@pytest.mark.parametrize("nodes", [(0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 1, 0), (0, 0, 0, 0), (0, 1, 2, 3)],
                         ids=["2x2", "interleaved", "crossed", "one-node", "one-rank-a-node"])
@BOTH_BACKENDS
def test_zero_s_reduce_scatter_cut_by_node_leaves_each_rank_the_sum_of_its_own_chunk(nodes, backend) -> None:
    """However the launcher placed the ranks (in blocks, interleaved, crossed so that a cross-node group's rank
    order is not the nodes'), on one node or one a node; fp16 sums these integers exactly too. Under NCCL's rules
    the node's reduce-scatter is the backend's own, which leaves local rank l shard l (the ring: l + 1)."""
    for codec in ("none", "fp16"):
        assert run_ranks(4, _scattered_against_the_sums, nodes, codec, backend=backend) == [[]] * 4, codec


def _int8_steps(world, per_node: int | None, steps: int, state=None, first: int = 0) -> tuple:
    """Steps ``first`` to ``first + steps`` of int8 reductions of per-rank, per-step gradients (error feedback
    on), hierarchical over nodes of ``per_node`` ranks or the flat ring (None); from ``state`` (a reducer's
    state_dict) if given. Returns the results, the reducer's state and the bytes this rank sent."""
    from parallel.compression.registry import make_reducer
    from parallel.transport import TorchTransport

    reducer = make_reducer("int8")
    if per_node is not None:
        reducer = HierarchicalReducer(reducer, build_node_groups(_mesh(world, per_node)))
    if state is not None:
        reducer.load_state_dict(state)
    results, sent = [], 0
    for step in range(first, first + steps):
        grad = _inputs(world.rank + 10 * step, 4099, integer=False).to(world.device)
        sent += reducer.reduce("bucket", [grad], TorchTransport(), average=True)
        results.append(grad.cpu())
    return results, {key: value.cpu() for key, value in reducer.state_dict().items()}, sent


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_int8_across_nodes_equals_its_cpu_path_bit_for_bit() -> None:
    """2 "nodes" x 2 ranks sharing the GPU over Gloo (NCCL refuses two ranks on one GPU): the exchange cut by node
    with int8 across nodes (the codec's Triton kernels on CUDA tensors) gives the CPU path's results, residuals
    and bytes bit for bit."""
    on_cpu = run_ranks(4, _int8_steps, 2, 3)
    on_gpu = run_ranks(4, _int8_steps, 2, 3, device="cuda", timeout=300)
    for (cpu, cpu_state, cpu_sent), (gpu, gpu_state, gpu_sent) in zip(on_cpu, on_gpu, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(cpu, gpu, strict=True)) and gpu_sent == cpu_sent
        assert sorted(gpu_state) == sorted(cpu_state) and all(torch.equal(cpu_state[k], gpu_state[k])
                                                              for k in cpu_state)


def _resumed(world, per_node: int) -> tuple:
    whole, _, _ = _int8_steps(world, per_node, 4)
    _, state, _ = _int8_steps(world, per_node, 2)
    cut = [tensor.clone() for tensor in state.values()]  # what a checkpoint would hold
    return whole, _int8_steps(world, per_node, 2, dict(zip(state, cut, strict=True)), first=2)[0], sorted(state)


def test_int8_across_nodes_keeps_a_residual_per_shard_and_resumes_it_bit_for_bit() -> None:
    for whole, resumed, keys in run_ranks(4, _resumed, 2):
        assert keys == ["residual/bucket/node-shard"]  # this rank's shard only: 4099 -> 2050 elements
        assert all(torch.equal(a, b) for a, b in zip(whole[2:], resumed, strict=True))


def _flat_and_hierarchical(world, per_node: int) -> tuple:
    return _int8_steps(world, None, 3), _int8_steps(world, per_node, 3)


def test_one_rank_a_node_is_the_flat_int8_ring_bit_for_bit() -> None:
    for (flat, flat_state, flat_sent), (ours, state, sent) in run_ranks(2, _flat_and_hierarchical, 1):
        assert all(torch.equal(a, b) for a, b in zip(flat, ours, strict=True)) and sent == flat_sent
        assert [torch.equal(state[f"{key}/node-shard"], value) for key, value in flat_state.items()] == [True]


def test_within_one_node_no_codec_runs_and_across_two_nodes_only_each_ranks_shard_crosses() -> None:
    """1 node x 4 ranks: exact (no int8 rounding), no residual; 2 x 2: what a rank sends across nodes is the 2-rank
    int8 ring on its half of the bucket, under 0.6x what it sends in the flat 4-rank int8 ring."""
    exact = [_inputs(rank + 10 * step, 4099, integer=False) for step in range(3) for rank in range(4)]
    means = [sum(exact[4 * step:4 * step + 4]) / 4 for step in range(3)]
    for (flat, _, _), (ours, state, _) in run_ranks(4, _flat_and_hierarchical, 4):
        assert state == {} and all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(ours, means, strict=True))
        assert not all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(flat, means, strict=True))
    for (_, _, flat_sent), (_, _, sent) in run_ranks(4, _flat_and_hierarchical, 2):
        inside = 3 * 2 * 2050 * 4  # 3 steps of a reduce-scatter and an all-gather of a 2050-float shard
        assert sent - inside < 0.6 * flat_sent  # what crossed: the 2-rank int8 ring on half the bucket


def _train(world, run_dir: str, name: str, per_node: int, compression: str, scope: str, zero: int = 0) -> list[float]:
    from jobs.train.loop import train

    spec = spec_from_dict({
        "job": {"run_dir": run_dir, "name": name, "seed": 5},
        "model": {"kind": "gpt", "n_layers": 2, "n_heads": 2, "d_model": 32, "seq_len": 16},
        "data": {"name": "licenses", "batch_size": 8},
        "train": {"steps": 6, "lr": 3e-3, "optimizer": "adam", "log_every": 100},
        "parallel": {"compression": compression, "compression_scope": scope, "bucket_mb": 0.01, "zero": zero},
    })
    mesh = build_mesh(MeshShape(world.size, 1, 1), world.rank, node_rank=world.rank // per_node)
    assert dp_nodes(mesh) == world.size // per_node
    train(spec, world, mesh)
    import json

    return [json.loads(line)["loss"] for line in (spec.run_path / "metrics.jsonl").open()] if world.rank == 0 else []


@pytest.mark.parametrize("backend", ["gloo", NCCL_RULES])
def test_the_gpt_trains_on_two_nodes_of_two_ranks_as_the_flat_exchange_does(tmp_path, backend) -> None:
    """Uncompressed, inter-node and flat give the same losses (sums in another order); int8 across nodes stays
    within the int8 ring's distance of them. Under NCCL's rules every group's order is the same on every rank."""
    flat = run_ranks(4, _train, str(tmp_path), "flat", 2, "none", "flat", backend=backend)[0]
    cut = run_ranks(4, _train, str(tmp_path), "cut", 2, "none", "inter-node", backend=backend)[0]
    int8 = run_ranks(4, _train, str(tmp_path), "int8", 2, "int8", "auto", backend=backend)[0]
    powersgd = run_ranks(4, _train, str(tmp_path), "powersgd", 2, "powersgd", "auto", backend=backend)[0]
    assert len(flat) == 6 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(flat, cut, strict=True))
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(flat, int8, strict=True)) and int8 != flat
    assert all(abs(a - b) <= 5e-2 * abs(a) for a, b in zip(flat, powersgd, strict=True)) and powersgd != flat


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_reduce_scatters_cut_by_node_and_trains_as_the_flat_exchange_does(tmp_path, zero) -> None:
    """ZeRO-2 and 3 on 2 nodes of 2 ranks: each bucket reduce-scattered inside the node, then across nodes, with
    no all-gather (HierarchicalReducer.reduce_scatter): uncompressed the flat ZeRO-0's losses (sums in another
    order), int8 within the int8 ring's distance; under NCCL's rules."""
    flat = run_ranks(4, _train, str(tmp_path), "flat", 2, "none", "flat", backend=NCCL_RULES)[0]
    cut = run_ranks(4, _train, str(tmp_path), f"cut-z{zero}", 2, "none", "inter-node", zero, backend=NCCL_RULES)[0]
    int8 = run_ranks(4, _train, str(tmp_path), f"int8-z{zero}", 2, "int8", "auto", zero, backend=NCCL_RULES)[0]
    assert len(cut) == 6 and all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(flat, cut, strict=True))
    assert all(abs(a - b) <= 2e-2 * abs(a) for a, b in zip(flat, int8, strict=True)) and int8 != flat


def _powersgd_steps(world, per_node: int | None, steps: int, state=None, first: int = 0) -> tuple:
    """As ``_int8_steps`` with PowerSGD (rank 2) on a bucket of two matrices and a vector."""
    from parallel.compression.registry import make_reducer
    from parallel.transport import TorchTransport

    reducer = make_reducer("powersgd", powersgd_rank=2)
    if per_node is not None:
        reducer = HierarchicalReducer(reducer, build_node_groups(_mesh(world, per_node)))
    if state is not None:
        reducer.load_state_dict({key: value.clone() for key, value in state.items()})
    results = []
    for step in range(first, first + steps):
        bucket = [_inputs(world.rank + 10 * step, numel, integer=False) for numel in (32 * 16, 16 * 8, 10)]
        bucket = [bucket[0].view(32, 16), bucket[1].view(16, 8), bucket[2]]
        reducer.reduce("bucket", bucket, TorchTransport(), average=True)
        results.append(bucket)
    return results, reducer.state_dict()


def _powersgd_cases(world) -> tuple:
    flat, _ = _powersgd_steps(world, None, 2)
    one_a_node, _ = _powersgd_steps(world, 1, 2) if world.size == 2 else (None, None)
    if world.size == 2:
        return flat, one_a_node
    one_node, one_node_state = _powersgd_steps(world, 4, 1)
    whole, _ = _powersgd_steps(world, 2, 4)
    _, state = _powersgd_steps(world, 2, 2)
    return one_node, one_node_state, whole[2:], _powersgd_steps(world, 2, 2, state, first=2)[0]


def test_powersgd_compresses_whole_matrices_across_nodes_only() -> None:
    """PowerSGD needs whole matrices: each is compressed across nodes by one local rank. One rank a node: the flat
    PowerSGD bit for bit; one node: exact; 2 x 2: warm starts and residuals resumed bit for bit."""
    for flat, ours in run_ranks(2, _powersgd_cases):
        assert all(torch.equal(a, b) for step, other in zip(flat, ours, strict=True)
                   for a, b in zip(step, other, strict=True))
    exact = [sum(_inputs(rank, numel, integer=False) for rank in range(4)) / 4 for numel in (32 * 16, 16 * 8, 10)]
    for one_node, state, whole, resumed in run_ranks(4, _powersgd_cases):
        assert state == {} and all(torch.allclose(a.reshape(-1), b, rtol=0, atol=1e-6)
                                   for a, b in zip(one_node[0], exact, strict=True))
        assert all(torch.equal(a, b) for step, other in zip(whole, resumed, strict=True)
                   for a, b in zip(step, other, strict=True))


def _node_stages(world, per_node: int, shared_dir: str, apart: bool) -> tuple:
    """The node's stages through its shared memory against the ring's over Gloo, on buckets that grow, shrink and
    change dtype, three rounds each (the segment sets alternate): mismatches, whether shared memory was used, and
    the files left in ``shared_dir``. ``apart``: each rank looks in a directory of its own, as ranks that share
    no /dev/shm would."""
    import os

    from parallel import node_memory
    from parallel.ring import ring_allgather, ring_reduce_scatter

    node_memory.SHARED_DIR = os.path.join(shared_dir, str(world.rank)) if apart else shared_dir
    os.makedirs(node_memory.SHARED_DIR, exist_ok=True)
    groups = build_node_groups(_mesh(world, per_node))
    g = groups.local_size
    memory = node_memory.NodeSharedMemory.attach(groups.node, groups.local_rank, g, 4 * g)
    wrong = []
    buckets = ((g, torch.float32), (4100 * g, torch.float32), (3 * g, torch.float32), (500 * g, torch.bfloat16))
    for numel, dtype in buckets:
        for round_ in range(3):
            x = _inputs(world.rank + 10 * round_, numel, integer=False).to(dtype)
            ring, ours = x.clone(), x.clone()
            ring_shard = ring_reduce_scatter(ring, groups.inside)
            if memory is None:
                continue
            shard = memory.reduce_scatter(ours)
            in_place = shard.data_ptr() == ours.view(g, -1)[(groups.local_rank + 1) % g].data_ptr()
            same = torch.equal(shard, ring_shard) and in_place
            ring_allgather(ring_shard, groups.inside, out=ring.view(g, -1), shift=1)
            memory.all_gather(ours, shard)
            if not (same and torch.equal(ours, ring)):
                wrong.append((numel, dtype, round_))
    wrong += _exact_against_the_flat_all_reduce(world, per_node)  # through the memory, or the ring where apart
    dist.barrier()
    return wrong, memory is not None, os.listdir(node_memory.SHARED_DIR)


@pytest.mark.parametrize("per_node", [2, 4])
def test_the_node_s_stages_through_shared_memory_equal_the_ring_s_bit_for_bit(tmp_path, per_node) -> None:
    """On the host the node's reduce-scatter and all-gather read the node's ranks' segments directly: the ring's
    sums in the ring's order, bit for bit, however the buckets change, and no file left behind."""
    assert run_ranks(4, _node_stages, per_node, str(tmp_path), False) == [([], True, [])] * 4


def test_ranks_that_share_no_memory_keep_the_ring(tmp_path) -> None:
    """Ranks that cannot see each other's segments (a /dev/shm each) all agree to keep the ring, and leave no
    file; the exchange cut by node then sums as before."""
    assert run_ranks(4, _node_stages, 2, str(tmp_path), True) == [([], False, [])] * 4
