"""The ring over a carrier that moves messages in lockstep, as NCCL does, simulated in threads.

On NCCL each batch of sends and receives a rank posts is one kernel on its one stream: it finishes only
once every message in it has met its match (the k-th message from a sender to a receiver, tags ignored)
in the peer's running batch, and the rank's next batch runs after it. ``Carrier(ordered=True)`` holds n
ranks' batches to exactly that; ``ordered=False`` matches any posted message whenever its partner (by
tag) is posted, as MPI and Gloo do. A state where every rank waits and no running batch can move is a deadlock,
raised in every rank.

The pipelined ring (receives posted ahead of this rank's sends) deadlocks under lockstep at any n, which
is why the ring runs ``run_in_lockstep`` where ``Transport.in_lockstep`` says so; that variant must move
the same bytes to the same sums: bit for bit the pipelined ring's results, for every codec, with error
feedback, at 2, 3 and 4 ranks, for the all-reduce, the reduce-scatter (ZeRO-2) and the all-gather (ZeRO-3).
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from parallel import ring
from parallel.compression.registry import make_codec

SEGMENT_BYTES = 1024 * 4  # 4 int8 blocks of 256 a segment: segments and whole chunks cut the same blocks


class Deadlock(RuntimeError):
    pass


@dataclass(eq=False)
class _Op:
    is_send: bool
    tensor: torch.Tensor
    pair: tuple  # (sender, receiver[, tag], k): the k-th message between them (with that tag, unless ordered)
    done: bool = False


@dataclass(eq=False)
class _Batch:
    ops: list[_Op]
    done: bool = False


@dataclass
class Carrier:
    """n ranks' posted batches and how they move (see the module docstring)."""

    n: int
    ordered: bool
    queues: list[deque] = field(init=False)
    counts: Counter = field(default_factory=Counter)
    cond: threading.Condition = field(default_factory=threading.Condition)
    waiting: dict[int, _Op | _Batch] = field(default_factory=dict)  # rank -> what it waits for
    returned: set[int] = field(default_factory=set)
    deadlocked: bool = False

    def __post_init__(self) -> None:
        self.queues = [deque() for _ in range(self.n)]

    def post(self, rank: int, ops) -> _Batch:
        with self.cond:
            batch = _Batch([])
            for op in ops:
                sender, receiver = (rank, op.peer) if op.is_send else (op.peer, rank)
                channel = (sender, receiver) if self.ordered else (sender, receiver, op.tag)  # NCCL ignores tags
                batch.ops.append(_Op(op.is_send, op.tensor, (*channel, self.counts[channel, op.is_send])))
                self.counts[channel, op.is_send] += 1
            self.queues[rank].append(batch)
            self._move()
            return batch

    def _running(self, rank: int) -> list[_Batch]:
        return list(self.queues[rank])[:1] if self.ordered else list(self.queues[rank])

    def _move(self) -> None:
        """Match what can be matched, retire finished batches, until nothing changes."""
        moved = True
        while moved:
            moved = False
            for rank in range(self.n):
                for batch in self._running(rank):
                    for op in batch.ops:
                        if op.done or not op.is_send:
                            continue
                        peer = op.pair[1]
                        match = next((o for b in self._running(peer) for o in b.ops
                                      if not o.done and not o.is_send and o.pair == op.pair), None)
                        if match is not None:
                            match.tensor.copy_(op.tensor)
                            op.done = match.done = moved = True
            for queue in self.queues:
                while queue and all(op.done for op in queue[0].ops):
                    queue.popleft().done = moved = True
                if not self.ordered:
                    for batch in [b for b in queue if all(op.done for op in b.ops)]:
                        batch.done = True
                        queue.remove(batch)
        self.cond.notify_all()

    def wait(self, rank: int, batch: _Batch, index: int) -> None:
        """Until the batch is done (ordered: one kernel, one completion), else its ``index``-th message."""
        awaited = batch if self.ordered else batch.ops[index]
        with self.cond:
            self.waiting[rank] = awaited
            try:
                while not awaited.done:
                    stuck = sum(not waited.done for waited in self.waiting.values()) + len(self.returned)
                    if self.deadlocked or stuck == self.n:
                        self.deadlocked = True
                        self.cond.notify_all()
                        raise Deadlock("every rank waits and no running batch can move")
                    self.cond.wait(timeout=1.0)
            finally:
                del self.waiting[rank]

    def leave(self, rank: int) -> None:
        with self.cond:
            self.returned.add(rank)
            self.cond.notify_all()


@dataclass
class SimulatedTransport:
    carrier: Carrier
    rank: int
    lockstep: bool
    name: str = "simulated"

    @property
    def group(self):
        return SimpleNamespace(rank=self.rank, size=self.carrier.n)

    def in_lockstep(self, device: torch.device) -> bool:
        return self.lockstep

    def post(self, ops):
        batch = self.carrier.post(self.rank, ops)
        return [SimpleNamespace(wait=lambda index=index: self.carrier.wait(self.rank, batch, index))
                for index in range(len(ops))]

    def send(self, tensor, peer, tag=0):
        return self.post([ring.PointToPoint(True, tensor, peer, tag)])[0]

    def recv(self, tensor, peer, tag=0):
        return self.post([ring.PointToPoint(False, tensor, peer, tag)])[0]


# What the ring and the pipeline ask torch.distributed of their group: here the simulated transport's.
SIMULATED_GROUPS = SimpleNamespace(get_world_size=lambda group: group.size, get_rank=lambda group: group.rank,
                                   get_process_group_ranks=lambda group: list(range(group.size)))


@pytest.fixture(autouse=True)
def _groups_of_the_simulation(monkeypatch):
    monkeypatch.setattr(ring, "dist", SIMULATED_GROUPS)


def _on_ranks(n: int, ordered: bool, lockstep: bool, work):
    """``work(rank, transport)`` on n threads; each rank's result, or the exception it raised."""
    carrier = Carrier(n, ordered)
    results: list[object] = [None] * n

    def rank_main(rank: int) -> None:
        try:
            results[rank] = work(rank, SimulatedTransport(carrier, rank, lockstep))
        except Exception as exc:  # handed to the test
            results[rank] = exc
        finally:
            carrier.leave(rank)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank never returned"
    return results


def _inputs(rank: int, n: int) -> torch.Tensor:
    return torch.randn(3 * 1024 * n + 37, generator=torch.Generator().manual_seed(rank))


def _allreduce(codec_name: str, n: int):
    def work(rank: int, transport) -> tuple[torch.Tensor, torch.Tensor]:
        flat, error = _inputs(rank, n), torch.zeros(3 * 1024 * n + 37)
        codec = make_codec(codec_name)
        ring.ring_allreduce(flat, transport, codec=codec, error=error, segment_bytes=SEGMENT_BYTES)
        return flat, error
    return work


def _reduce_scatter(codec_name: str, n: int):
    def work(rank: int, transport) -> tuple[torch.Tensor, torch.Tensor]:
        flat, error = _inputs(rank, n), torch.zeros(3 * 1024 * n + 37)
        owned = ring.ring_reduce_scatter(flat, transport, codec=make_codec(codec_name), error=error,
                                         segment_bytes=SEGMENT_BYTES, average=True)
        return owned.clone(), error
    return work


CODECS = ["none", "fp16", "bf16", "int8"]


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("phase", [_allreduce, _reduce_scatter], ids=["allreduce", "reduce_scatter"])
@pytest.mark.parametrize("codec", CODECS)
def test_in_lockstep_the_ring_moves_the_pipelined_rings_bytes_without_deadlock(n, phase, codec) -> None:
    expected = _on_ranks(n, ordered=False, lockstep=False, work=phase(codec, n))
    got = _on_ranks(n, ordered=True, lockstep=True, work=phase(codec, n))
    for rank in range(n):
        assert not isinstance(expected[rank], Exception), expected[rank]
        assert not isinstance(got[rank], Exception), got[rank]
        for want, have in zip(expected[rank], got[rank], strict=True):
            assert torch.equal(want, have), (codec, n, rank)
    flats = [_inputs(rank, n) for rank in range(n)]
    if codec == "none" and phase is _allreduce:  # and the sum is the sum
        torch.testing.assert_close(got[0][0], sum(flats), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("n", [2, 3])
def test_the_pipelined_ring_deadlocks_in_lockstep(n) -> None:
    """What run_in_lockstep avoids: the simulation holds the pipelined ring's receives to NCCL's order."""
    results = _on_ranks(n, ordered=True, lockstep=False, work=_allreduce("fp16", n))
    assert all(isinstance(result, Deadlock) for result in results), results


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_all_gather_moves_in_lockstep(n) -> None:
    def work(rank: int, transport) -> torch.Tensor:
        return ring.ring_allgather(torch.full((5,), float(rank)), transport)

    for gathered in _on_ranks(n, ordered=True, lockstep=True, work=work):
        assert torch.equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(5).view(n, 5))


def _pipeline(schedule_actions, p: int, m: int, v: int):
    """One step of a pipeline of 2 p v linear layers under ``schedule_actions`` (per rank); each rank's loss (last
    stage) and its gradients."""
    from torch import nn

    from parallel.pipeline import run_pipeline_step, split_into_stages

    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(2 * p * v):
        layer = nn.Linear(8, 8)
        with torch.no_grad():
            layer.weight.copy_(torch.randn(8, 8, generator=generator) / 3)
            layer.bias.copy_(torch.randn(8, generator=generator))
        layers.append(nn.Sequential(layer, nn.Tanh()))
    x, y = torch.randn(2 * m, 8, generator=generator), torch.randn(2 * m, 8, generator=generator)
    stages = split_into_stages(layers, p, v)

    def work(rank: int, transport) -> tuple[float | None, list[torch.Tensor]]:
        stats = run_pipeline_step(schedule_actions[rank], stages[rank], transport.group, activation_shape=(2, 8),
                                  loss_fn=nn.functional.mse_loss, inputs=x.chunk(m), targets=y.chunk(m),
                                  transport=transport)
        return stats.loss, [param.grad.clone() for chunk in stages[rank] for param in chunk.parameters()]
    return work


def _layouts(ps):
    """(schedule, p, m, v): every schedule over p in ``ps``, m in {1, p, 2p, 4p} (interleaved: multiples of p),
    v in {2, 3} for interleaved."""
    return [(name, p, m, v) for p in ps for m in sorted({1, p, 2 * p, 4 * p})
            for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3))) for v in vs
            if name != "interleaved" or m % p == 0]


def _runs_in_lockstep(monkeypatch, name: str, p: int, m: int, v: int) -> None:
    """The executor's messages under NCCL's rules, threaded: no deadlock, and the losses and gradients of the
    same schedule over a carrier that matches by tag (Gloo)."""
    from parallel import pipeline
    from parallel.schedule import build_schedule, lockstep_deadlock

    monkeypatch.setattr(pipeline, "dist", SIMULATED_GROUPS)
    schedule = build_schedule(name, p, m, v)
    assert lockstep_deadlock(schedule) is None
    expected = _on_ranks(p, ordered=False, lockstep=False, work=_pipeline(schedule, p, m, v))
    got = _on_ranks(p, ordered=True, lockstep=True, work=_pipeline(schedule, p, m, v))
    for rank in range(p):
        assert not isinstance(got[rank], Exception), (name, p, m, v, got[rank])
        assert got[rank][0] == expected[rank][0]
        for want, have in zip(expected[rank][1], got[rank][1], strict=True):
            assert torch.equal(want, have), (name, p, m, v, rank)


@pytest.mark.parametrize("name, p, m, v", _layouts(range(2, 5)))
def test_every_schedule_moves_in_lockstep_and_trains_as_over_gloo(monkeypatch, name, p, m, v) -> None:
    _runs_in_lockstep(monkeypatch, name, p, m, v)


@pytest.mark.slow
@pytest.mark.parametrize("name, p, m, v", _layouts(range(5, 9)))
def test_every_schedule_on_up_to_eight_ranks_moves_in_lockstep(monkeypatch, name, p, m, v) -> None:
    _runs_in_lockstep(monkeypatch, name, p, m, v)


def test_no_schedule_on_up_to_eight_ranks_deadlocks_under_nccls_rules() -> None:
    """The issue's sweep, on the pure model: p in 2..8, m in {1, p, 2p, 3p}, v in {2, 3}."""
    from parallel.schedule import build_schedule, lockstep_deadlock

    layouts = [(name, p, m, v) for p in range(2, 9) for m in sorted({1, p, 2 * p, 3 * p})
               for name, vs in (("gpipe", (1,)), ("1f1b", (1,)), ("interleaved", (2, 3))) for v in vs
               if name != "interleaved" or m % p == 0]
    assert [layout for layout in layouts if lockstep_deadlock(build_schedule(*layout))] == []


def _one_warmup_forward_fewer(p: int, m: int, v: int):
    """Interleaved 1F1B as built before Megatron's warm-up count: (p-r-1) + (v-1) p forwards on rank r."""
    from parallel.schedule import _with_messages

    total = m * v

    def step(kind: str, k: int, rank: int):
        group, within = divmod(k, p * v)
        chunk = within // p if kind == "F" else v - 1 - within // p
        return kind, group * p + within % p, chunk * p + rank

    orders = []
    for r in range(p):
        warmup = min((p - r - 1) + (v - 1) * p, total)
        order = [step("F", k, r) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step("F", warmup + k, r), step("B", k, r)]
        orders.append(order + [step("B", k, r) for k in range(total - warmup, total)])
    return _with_messages(orders, p, v)


@pytest.mark.parametrize("p, m, v", [(3, 6, 2), (4, 8, 2), (4, 12, 3)])
def test_one_warmup_forward_fewer_deadlocks_interleaved_under_nccls_rules(monkeypatch, p, m, v) -> None:
    """The schedule before (issue 39: m > p hung on a cluster): the model names it, and the executor, run under
    NCCL's rules, hangs in every rank."""
    from parallel import pipeline
    from parallel.schedule import lockstep_deadlock

    monkeypatch.setattr(pipeline, "dist", SIMULATED_GROUPS)
    schedule = _one_warmup_forward_fewer(p, m, v)
    assert lockstep_deadlock(schedule).startswith("every rank waits")
    results = _on_ranks(p, ordered=True, lockstep=True, work=_pipeline(schedule, p, m, v))
    assert all(isinstance(result, Deadlock) for result in results), results
