"""NCCL's rules on the CPU: a torch.distributed backend under which the project's real code runs as on NCCL.

Gloo, which every other multi-rank CPU test uses, forgives what NCCL does not: it buffers a send whatever the
receiver does, matches messages by tag, and lets each collective run whenever its group is ready. A job that
passes on Gloo may hang on a cluster. ``ncclrules`` (``register``) is a process group per communicator that
moves tensors over Gloo (collectives) and the rendezvous store (point-to-point), and schedules them as NCCL does:

* one in-order queue per rank: every communicator's work runs in the order the rank issued it, as one stream
  per communicator runs it once kernels share one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``, which the
  launcher forwards and Megatron's overlap needs): work two ranks issue in different orders hangs here as there,
  whichever host threads issue it;
* a collective starts once every rank of its group reached it, and must be the same on all: operation, shapes,
  dtypes, reduction and root (``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s fingerprint, checked at every call);
* a batch of sends and receives (one ``batch_isend_irecv``, one NCCL group) runs as one: a send completes only
  once its peer runs the matching receive, and the k-th message from one rank to another meets the k-th receive
  posted for it (NCCL ignores tags: a different tag there is a message matched to the wrong receive, named);
* every rank waiting, with nothing able to move for ``STALL_S``, is a deadlock: each raises, naming what every
  rank waits for and on whom.

The ring, the pipeline, the DP optimizer and ZeRO ask whether a backend keeps NCCL's rules by its name
(``hpc.runtime.placement.carries_cuda``), so they take their NCCL paths here. Ranks started by
``tests.ranks.run_ranks(..., backend=BACKEND)`` use it.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

BACKEND = "ncclrules"
STALL_S = 3.0  # every rank waiting this long, with no change: a deadlock
JITTER_S = 0.01  # at most this long before work another thread than the main one issues is queued
_STATE = "ncclrules/state/{rank}"


class NcclRulesError(RuntimeError):
    """A rule NCCL enforces by hanging or by delivering the wrong bytes, named."""


class _RankQueue:
    """This rank's one queue: every communicator's work, run in issue order on one thread."""

    def __init__(self, store, rank: int, size: int) -> None:
        self.store, self.rank, self.n = store, rank, size
        self.items: queue.Queue = queue.Queue()
        self.progress, self.failed = 0, None
        self.jitter = random.Random(rank)
        self._publish(None)
        threading.Thread(target=self._serve, name="ncclrules-queue", daemon=True).start()

    def submit(self, run: Callable[[], object]) -> _Work:
        """Queue ``run``. Issued from another thread than the main one, it first waits a moment drawn from this
        rank's own seed: two threads issuing in an order that only timing keeps (a busy GPU node's host does
        not keep it) issue in different orders on different ranks, and what that deadlocks does."""
        if threading.current_thread() is not threading.main_thread():
            time.sleep(self.jitter.uniform(0, JITTER_S))
        work = _Work()
        self.items.put((run, work))
        return work

    def _serve(self) -> None:
        while True:
            run, work = self.items.get()
            result = None
            try:
                if self.failed:
                    raise NcclRulesError(self.failed)
                result = run()
            except BaseException as exc:  # handed to the rank's wait
                self.failed = self.failed or (str(exc) if isinstance(exc, NcclRulesError)
                                              else f"{type(exc).__name__}: {exc}")
                work.error = exc
            self.progress += 1
            work.finish(result)

    def _publish(self, waiting: dict | None, done: bool = False) -> None:
        state = {"waiting": waiting, "progress": self.progress, "done": done}
        self.store.set(_STATE.format(rank=self.rank), json.dumps(state))

    def leave(self) -> None:
        """This rank issues nothing more (its function returned or raised)."""
        self._publish(None, done=True)

    def wait_until(self, moved: Callable[[], bool], what: str, missing: Callable[[], list[int]]) -> None:
        """Until ``moved()`` says the work is done; a deadlock (every rank waiting, nothing changing) raises."""
        if moved():
            return
        self._publish({"what": what, "missing": missing()})
        since, delay = time.monotonic(), 1e-4
        while not moved():
            time.sleep(delay)
            delay = min(2 * delay, 0.005)
            if time.monotonic() - since > STALL_S:
                self._publish({"what": what, "missing": missing()})
                if (why := self._deadlock()) and not moved():  # moved meanwhile: the others were only slow
                    raise NcclRulesError(why)
                since = time.monotonic()
        self._publish(None)

    def _states(self) -> list[dict]:
        return [json.loads(self.store.get(_STATE.format(rank=rank))) for rank in range(self.n)]

    def _deadlock(self) -> str | None:
        """What every rank waits for, when all wait (or left) and nothing changed over half a stall."""
        before = self._states()
        if any(not s["done"] and s["waiting"] is None for s in before):
            return None  # a rank computes: it may yet issue what the others wait for
        time.sleep(STALL_S / 2)
        if self._states() != before:
            return None
        lines = [f"rank {rank} has left" if s["done"] else
                 f"rank {rank} waits in {s['waiting']['what']} for ranks {s['waiting']['missing']}"
                 for rank, s in enumerate(before)]
        return "deadlock under NCCL's rules: " + "; ".join(lines)


class _Work(dist.Work):
    """Done once the queue ran it; ``wait`` raises what running it raised (a Work made from a future does not).
    Its future (DDP's reducer asks for one) holds the tensors the work wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.finished, self.error = threading.Event(), None
        self.result: object = None
        self.future: torch.futures.Future | None = None
        self.lock = threading.Lock()

    def finish(self, result: object) -> None:
        with self.lock:
            self.result = result
            self.finished.set()
            if self.future is not None:
                self._settle()

    def get_future(self) -> torch.futures.Future:
        with self.lock:
            if self.future is None:
                self.future = torch.futures.Future()
                if self.finished.is_set():
                    self._settle()
            return self.future

    def _settle(self) -> None:
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.result)

    def wait(self, timeout=None) -> bool:
        self.finished.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def is_success(self) -> bool:
        return self.finished.is_set() and self.error is None


class _Each:
    """Works run as one: ``wait`` waits for every one of them."""

    def __init__(self, works: list[dist.Work]) -> None:
        self.works = works

    def wait(self) -> bool:
        return all(work.wait() for work in self.works)


_QUEUE: _RankQueue | None = None


def _reduction(opts) -> str:
    op = opts.reduceOp
    return str(getattr(op, "op", op)).rsplit(".", 1)[-1]  # RedOpType.SUM -> SUM (a ReduceOp prints its address)


def _fingerprint(name: str, tensors, extra: object = "") -> str:
    shapes = [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]
    return f"{name} {shapes} {extra}".strip()


class RulesGroup(dist.ProcessGroup):
    """One communicator under NCCL's rules (see the module docstring)."""

    def __init__(self, options) -> None:
        super().__init__(options.group_rank, options.group_size)
        self.me, self.n = options.group_rank, options.group_size
        self.ranks = list(options.global_ranks_in_group) or list(range(options.group_size))
        self.store = options.store  # this group's keys
        self.inner = dist.ProcessGroupGloo(dist.PrefixStore("gloo", options.store), self.me, self.n,
                                           options.timeout)
        self.label = f"group {self.ranks}"
        self.registered_name = options.group_id
        self.calls = 0
        self.issued: dict[str, int] = defaultdict(int)  # what this rank issued on the group, by operation
        self.channels: dict[tuple[int, int], int] = defaultdict(int)

    @property
    def group_name(self) -> str:
        """The name torch registers this group under: functional collectives find it by that, and
        ``destroy_process_group`` unregisters it by that once its own tables have let the group go."""
        return self.registered_name

    def getBackendName(self) -> str:
        return BACKEND

    # --- collectives -------------------------------------------------------------------------

    def _collective(self, name: str, fingerprint: str, run: Callable[[], dist.Work], result) -> dist.Work:
        self.issued[name] += 1
        call = self.calls
        self.calls += 1
        what = f"{self.label} {name} #{call} ({fingerprint})"
        key = f"c{call}/" + "{}"

        keys = [key.format(r) for r in range(self.n)]

        def start() -> object:
            self.store.set(key.format(self.me), fingerprint)
            _QUEUE.wait_until(lambda: self.store.check(keys), what,
                              lambda: [self.ranks[r] for r in range(self.n) if not self.store.check([keys[r]])])
            prints = {r: self.store.get(key.format(r)).decode() for r in range(self.n)}
            if len(set(prints.values())) > 1:
                seen = "; ".join(f"rank {self.ranks[r]}: {p}" for r, p in prints.items())
                raise NcclRulesError(f"{self.label} call #{call}: the ranks entered different collectives: {seen}")
            run().wait()
            return result
        return _QUEUE.submit(start)

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()
        return self._collective("all_reduce", _fingerprint("all_reduce", tensors, _reduction(opts)),
                                lambda: self.inner.allreduce(tensors, opts), tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = opts or dist.AllreduceCoalescedOptions()
        return self._collective("all_reduce_coalesced", _fingerprint("all_reduce", tensors, _reduction(opts)),
                                lambda: self.inner.allreduce_coalesced(tensors, opts), tensors)

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()
        return self._collective("broadcast", _fingerprint("broadcast", tensors, f"root {opts.rootRank}"),
                                lambda: self.inner.broadcast(tensors, opts), tensors)

    def barrier(self, opts=None):
        opts = opts or dist.BarrierOptions()
        return self._collective("barrier", "barrier", lambda: self.inner.barrier(opts), [])

    def allgather(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather", _fingerprint("all_gather", inputs + [t for ts in outputs for t in ts]),
                                lambda: self.inner.allgather(outputs, inputs, opts), outputs)

    def _allgather_base(self, output, input, opts=None):
        opts = opts or dist.AllgatherOptions()
        return self._collective("all_gather_into_tensor", _fingerprint("all_gather_into_tensor", [input, output]),
                                lambda: self.inner._allgather_base(output, input, opts), [output])

    all_gather_single = _allgather_base  # torch 2.13's name for it

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        opts = opts or dist.AllgatherOptions()
        # one NCCL group of all-gathers; Gloo has no coalesced form, so it runs them one after another
        return self._collective("all_gather_into_tensor", _fingerprint("all_gather_into_tensor", inputs + outputs),
                                lambda: _Each([self.inner._allgather_base(out, tensor, opts)
                                               for out, tensor in zip(outputs, inputs, strict=True)]), outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        flat = [t for group in inputs for t in group]
        return self._collective("reduce_scatter", _fingerprint("reduce_scatter", outputs + flat, _reduction(opts)),
                                lambda: self.inner.reduce_scatter(outputs, inputs, opts), outputs)

    def _reduce_scatter_base(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._collective("reduce_scatter_tensor",
                                _fingerprint("reduce_scatter_tensor", [input, output], _reduction(opts)),
                                lambda: self.inner._reduce_scatter_base(output, input, opts), [output])

    reduce_scatter_single = _reduce_scatter_base  # torch 2.13's name for it

    def alltoall_base(self, output, input, output_splits, input_splits, opts=None):
        opts = opts or dist.AllToAllOptions()
        # uneven splits differ between ranks by design: the fingerprint is the operation and the dtype
        return self._collective("all_to_all_single", f"all_to_all_single {input.dtype!s}",
                                lambda: self.inner.alltoall_base(output, input, output_splits, input_splits, opts),
                                [output])

    def alltoall(self, outputs, inputs, opts=None):
        """``dist.all_to_all`` of lists (one NCCL group of sends and receives there): Gloo has only the one-tensor
        form, so the pieces travel in one buffer, each piece's size its split."""
        opts = opts or dist.AllToAllOptions()
        send = torch.cat([t.reshape(-1) for t in inputs])
        received = send.new_empty(sum(t.numel() for t in outputs))

        def run() -> _Each:
            work = self.inner.alltoall_base(received, send, [t.numel() for t in outputs], [t.numel() for t in inputs],
                                            opts)
            work.wait()
            for out, piece in zip(outputs, received.split([t.numel() for t in outputs]), strict=True):
                out.copy_(piece.view_as(out))
            return _Each([])  # done: nothing left to wait for

        return self._collective("all_to_all", f"all_to_all {send.dtype!s}", run, outputs)

    # --- point to point ----------------------------------------------------------------------

    def send(self, tensors, dst: int, tag: int):
        return self.post([(True, tensors[0], dst, tag)])[0]

    def recv(self, tensors, src: int, tag: int):
        return self.post([(False, tensors[0], src, tag)])[0]

    def post(self, ops: list[tuple[bool, torch.Tensor, int, int]]) -> list[dist.Work]:
        """One batch (one NCCL group): its sends and receives run together, completing when all have met."""
        self.issued["point-to-point"] += len(ops)
        messages = []
        for is_send, tensor, peer, tag in ops:
            channel = (self.me, peer) if is_send else (peer, self.me)
            messages.append(_Message(is_send, tensor, peer, tag, channel, self.channels[channel, is_send]))
            self.channels[channel, is_send] += 1
        work = _QUEUE.submit(lambda: self._run_batch(messages))
        return [work] * len(messages)

    def _run_batch(self, messages: list[_Message]) -> object:
        for message in messages:
            if not message.is_send:  # this receive now runs: its sender may go
                self.store.set(message.key("posted"), str(message.tag))
        pending = list(messages)

        def moved() -> bool:
            waiting_channels = set()  # a channel delivers in order: a later message never overtakes a waiting one
            for message in list(pending):
                if message.channel in waiting_channels:
                    continue
                if message.is_send and self.store.check([message.key("posted")]):
                    posted = int(self.store.get(message.key("posted")))
                    if posted != message.tag:
                        raise NcclRulesError(
                            f"{self.label}: rank {self.ranks[self.me]}'s message {message.base} to rank "
                            f"{self.ranks[message.peer]} (tag {message.tag}) met a receive posted for tag {posted}: "
                            "NCCL matches messages in order, not by tag")
                    self.store.set(message.key("data"), _as_bytes(message.tensor))
                    pending.remove(message)
                elif not message.is_send and self.store.check([message.key("data")]):
                    _fill(message.tensor, self.store.get(message.key("data")), self.label)
                    pending.remove(message)
                else:
                    waiting_channels.add(message.channel)
            return not pending

        what = f"{self.label} batch of " + ", ".join(str(m) for m in messages)
        _QUEUE.wait_until(moved, what, lambda: sorted({self.ranks[m.peer] for m in pending}))
        return [message.tensor for message in messages]


class _Message:
    """The ``k``-th message of a channel (sender, receiver), as one end posts it: both ends name it alike."""

    def __init__(self, is_send: bool, tensor: torch.Tensor, peer: int, tag: int, channel: tuple[int, int],
                 k: int) -> None:
        self.is_send, self.tensor, self.peer, self.tag, self.channel = is_send, tensor, peer, tag, channel
        self.base = f"p{channel[0]}>{channel[1]}/{k}"

    def key(self, what: str) -> str:
        return f"{self.base}/{what}"

    def __str__(self) -> str:
        return f"{'send to' if self.is_send else 'receive from'} {self.peer} (tag {self.tag}, message {self.base})"


def _as_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def _fill(tensor: torch.Tensor, data: bytes, label: str) -> None:
    if len(data) != tensor.nbytes:
        raise NcclRulesError(f"{label}: a message of {len(data)} bytes met a receive of {tensor.nbytes} bytes")
    if data:  # an empty message (NCCL sends zero bytes alike) has nothing to copy
        tensor.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(tensor.dtype).view(tensor.shape))


def _batch_isend_irecv(original: Callable) -> Callable:
    """``dist.batch_isend_irecv`` that hands a batch on a RulesGroup to it whole (torch coalesces only its own
    ProcessGroup class's batches, NCCL's; a Python group would get the messages one by one)."""
    def batch(p2p_ops):
        group = p2p_ops[0].group if p2p_ops else None
        if not isinstance(group, RulesGroup):
            return original(p2p_ops)
        return group.post([(op.op is dist.isend, op.tensor, op.group_peer, op.tag) for op in p2p_ops])
    return batch


def _all_gather_tensor(original: Callable) -> Callable:
    """``funcol.all_gather_tensor`` through ``RulesGroup.all_gather_single`` for a RulesGroup: its C++ operator
    calls a method torch's Python process groups cannot override."""
    def gather(tensor: torch.Tensor, gather_dim: int, group, tag: str = ""):
        if not isinstance(group, RulesGroup):
            return original(tensor, gather_dim, group, tag)
        out = tensor.new_empty((group.size() * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out if gather_dim == 0 else torch.cat(out.chunk(group.size()), dim=gather_dim)
    return gather


def _create(options, backend_options) -> RulesGroup:
    global _QUEUE
    if _QUEUE is None:  # the world group is created first, by every rank: its store is the job's
        store = options.store
        while isinstance(store, dist.PrefixStore):
            store = store.underlying_store
        _QUEUE = _RankQueue(store, options.group_rank, options.group_size)
    return RulesGroup(options)


def register() -> None:
    """Make ``BACKEND`` a torch.distributed backend in this process (before joining)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
        dist.batch_isend_irecv = _batch_isend_irecv(dist.batch_isend_irecv)
        funcol.all_gather_tensor = _all_gather_tensor(funcol.all_gather_tensor)


def leave() -> None:
    """This rank issues nothing more: a peer still waiting for it is then deadlocked, and says so."""
    if _QUEUE is not None:
        _QUEUE.leave()
