"""Horovod's DistributedOptimizer on our ring: fused gradient buckets reduced while backward runs.

Buckets go through the reducer of the spec's codec: our ring, which re-encodes at every hop, or
for an uncompressed bucket on the torch transport the backend's own all-reduce
(``parallel/compression/casts.py`` says why).

Each parameter gets a hook that fires once its gradient is accumulated. Parameters
are packed, in reverse registration order (roughly the order backward produces
their gradients), into buckets of at most ``bucket_bytes``; a bucket whose
gradients are all ready is handed to one communication thread, so its reduction
overlaps the rest of backward. Buckets are launched strictly in bucket order, the
same on every rank, because ring messages are matched by order (Horovod negotiates
the order through a coordinator; DDP fixes it the same way we do).

Under NCCL the thread would break NCCL's rule that one host thread issues every communicator's work in one
order on every rank: the DP thread's reductions and the main thread's TP, pipeline and EP collectives could
interleave differently on two ranks, which deadlocks once kernels share a queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``).
There, reductions are issued where backward's hooks fire (``InlineExecutor``), at the same point of backward on
every rank, and overlap through the communication stream instead: NCCL's calls return once queued. Under NCCL a
bucket with nothing compressed goes through the backend's own collectives (ZeRO-2's reduce-scatter, ZeRO-3's
all-gather: NVLS, SHARP, its tuned algorithms), not our ring.

The wrapper is a dynamic subclass of the wrapped optimizer's class sharing its
state, as Horovod does, so ``isinstance``, ``param_groups`` and LR schedulers keep
working. ``step()`` waits for the reductions first, unless inside
``skip_synchronize()`` after an explicit ``synchronize()`` (for gradient clipping).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hpc.observe.probe import Probe
from hpc.observe.stopwatch import Stopwatch
from hpc.runtime.placement import CommStream, use_device
from parallel.compression.base import Reducer
from parallel.compression.registry import make_reducer
from parallel.transport import Transport
from parallel.zero import ShardedParameters, ZeroShards

DEFAULT_BUCKET_BYTES = 25 << 20


@dataclass
class Bucket:
    index: int
    params: list[torch.nn.Parameter]
    ready: int = 0

    @property
    def key(self) -> str:
        return f"bucket{self.index}"


@dataclass
class CommStats:
    """What the last synchronized step sent: for tests, metrics and the timeline. Its times are the device's
    (``hpc/observe/stopwatch.py``): read them after the step's host synchronization."""

    device: torch.device
    collectives: int = 0
    bytes_sent: int = 0  # on the wire, by this rank
    raw_bytes: int = 0  # what an uncompressed ring all-reduce sends, 2 (n-1)/n of the gradients' size
    launch_times: list[float] = field(default_factory=list)  # host clock: when each bucket was handed over
    reduce: Stopwatch = field(init=False)  # inside reductions, on the communication stream, overlapped or not
    wait: Stopwatch = field(init=False)  # the compute stream held up by reductions: what overlap did not hide

    def __post_init__(self) -> None:
        self.reduce, self.wait = Stopwatch(self.device), Stopwatch(self.device)

    @property
    def reduce_seconds(self) -> float:
        return self.reduce.seconds()

    @property
    def wait_seconds(self) -> float:
        return self.wait.seconds()


class BucketViews:
    """Gradients as views of one flat buffer per bucket, as DDP's ``gradient_as_bucket_view``: the ring
    reduces that buffer in place, with no copy into a bucket and back and no fresh allocation (page
    faults) per step; ``zero_grad`` zeroes the buffers instead of dropping the gradients, and autograd
    accumulates into the views. A bucket mixing dtypes or devices keeps plain gradients."""

    def __init__(self, buckets: list[Bucket]):
        self.buffers: list[torch.Tensor] = []
        self.views: dict[torch.nn.Parameter, torch.Tensor] = {}
        for bucket in buckets:
            first = bucket.params[0]
            if any(p.dtype != first.dtype or p.device != first.device for p in bucket.params):
                continue
            flat = torch.zeros(sum(p.numel() for p in bucket.params), dtype=first.dtype, device=first.device)
            self.buffers.append(flat)
            for param, view in zip(bucket.params, flat.split([p.numel() for p in bucket.params]), strict=True):
                self.views[param] = view.view_as(param)

    def adopt(self, param: torch.nn.Parameter) -> None:
        """A gradient autograd allocated (the first backward, or after ``zero_grad``) moves into its view."""
        view = self.views.get(param)
        if view is not None and param.grad is not None and param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view

    def reset(self) -> None:
        for flat in self.buffers:
            flat.zero_()
        for param, view in self.views.items():
            param.grad = view


class InlineExecutor(Executor):
    """Runs each submitted call at once on the submitting thread (see the module docstring: NCCL's one issuing
    thread); its future is done when returned."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # handed to whoever waits, as a thread's executor would
            future.set_exception(exc)
        return future


def make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[Bucket]:
    """Greedy packing in the given order; a parameter larger than the threshold gets its own bucket."""
    buckets: list[Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets


class DistributedOptimizerMixin:
    """Placed before the wrapped optimizer's class in a dynamic subclass; see ``distributed_optimizer``."""

    def _setup(
        self,
        params: list[torch.nn.Parameter],
        transport: Transport,
        reducer: Reducer,
        bucket_bytes: int,
        backward_passes_per_step: int,
        average: bool,
        overlap: bool,
        warmup_steps: int,
        probe: Probe,
        zero: int = 0,
        module: torch.nn.Module | None = None,
        bucket_views: bool = False,
        owned_first: list[torch.nn.Parameter] | None = None,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
        self.transport, self.reducer, self.average = transport, reducer, average
        self.exact_reducer, self.warmup_steps, self.steps_synchronized = make_reducer("none"), warmup_steps, 0
        self._alone = dist.get_world_size(transport.group) == 1
        self.probe, self._peers = probe, dist.get_process_group_ranks(transport.group)
        self.backward_passes_per_step = backward_passes_per_step
        self.buckets = make_buckets(list(reversed(params)), bucket_bytes)
        self._bucket_of = {param: bucket for bucket in self.buckets for param in bucket.params}
        # ZeRO-2/3 drop the gradients others own: their buckets are not kept whole
        # alone, nothing is reduced: plain gradients, freed by zero_grad as a single-device loop frees them
        self._views = BucketViews(self.buckets) if bucket_views and zero < 2 and not self._alone else None
        self._passes = dict.fromkeys(params, 0)
        self._next_launch = 0
        self._futures: list[Future] = []
        device = params[0].device if params else torch.device("cpu")
        # the thread's current device is the rank's: kernels launched there without a tensor to follow (Triton's
        # codecs, torch.cuda defaults) land on this rank's GPU, not GPU 0
        self._lockstep = transport.in_lockstep(device)
        self._executor: Executor | None = None
        if overlap:
            self._executor = InlineExecutor() if self._lockstep else ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="hpc-dp-comm", initializer=use_device, initargs=(device,))
        self._skip_sync = False
        self._device = device
        self._stream = CommStream(device)
        self.stats = CommStats(self._device)
        self._pending_stats = CommStats(self._device)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]
        self._momentum = reducer.momentum_correction(self)  # top-k applies SGD's momentum before reducing
        # alone with no momentum to apply, a bucket has nothing to exchange
        self._idle = self._alone and self._momentum is None
        # ZeRO (parallel/zero.py): stage 2 assigns owners per bucket, so each bucket reduce-scatters to them
        buckets = [bucket.params for bucket in self.buckets] if zero >= 2 else ()
        self.zero = ZeroShards(params, transport.group, buckets, owned_first or ()) if zero else None
        self.zero_stage, self.sharded = zero, None
        if zero >= 3 and not self._alone:  # alone, a rank owns everything: nothing to gather
            if module is None:
                raise ValueError("zero=3 needs the module whose parameters it shards (module=)")
            self.sharded = ShardedParameters(self.zero, [bucket.params for bucket in self.buckets], module, transport,
                                             self._executor, self._stream, probe, self._peers)

    def _grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._views is not None:
            self._views.adopt(param)
        self._passes[param] += 1
        if self._passes[param] != self.backward_passes_per_step:
            return
        self._bucket_of[param].ready += 1
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self._next_launch += 1
        if self._idle:  # only unused gradients to fill in: here, no thread or stream hand-off
            self._reduce_now(bucket)
            return
        self._pending_stats.launch_times.append(time.perf_counter())
        if self._executor is None:  # no overlap: compute waits for each bucket (on a GPU, its stream too)
            with self._pending_stats.wait.timing():
                self._reduce(bucket, self._stream.ready())
                self._stream.join()
        else:
            self._futures.append(self._executor.submit(self._reduce, bucket, self._stream.ready()))

    def _reduce(self, bucket: Bucket, ready: object | None = None) -> None:
        """Reduce a bucket on the communication stream, once the event ``ready`` (its last gradient) passed."""
        with self._stream.after(ready):
            self._reduce_now(bucket)

    def _reduce_now(self, bucket: Bucket) -> None:
        grads = []
        for param in bucket.params:
            if param.grad is None:  # unused on this step: reduce zeros so every rank sends the same bytes
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        if self._momentum is not None:
            self._momentum.apply(bucket.key, grads)
        if self._alone:  # nothing to exchange, and compressing would only lose information
            return
        started = self._pending_stats.reduce.mark()
        reducer = self.reducer if self.steps_synchronized >= self.warmup_steps else self.exact_reducer
        size = sum(grad.nbytes for grad in grads)
        scatter = self.zero_stage >= 2
        with self.probe.collective(f"{'reduce-scatter' if scatter else 'allreduce'} {bucket.key}", "grad-reduce",
                                   self._peers, codec=reducer.name, bytes=size):
            sent = self._scatter(bucket, reducer) if scatter else reducer.reduce(bucket.key, grads, self.transport,
                                                                                   self.average)
        self._pending_stats.collectives += 1
        self._pending_stats.bytes_sent += sent
        n = len(self._peers)
        self._pending_stats.raw_bytes += 2 * (n - 1) * size // n
        self._pending_stats.reduce.add(started)

    def _scatter(self, bucket: Bucket, reducer: Reducer) -> int:
        """ZeRO stage 2: the bucket reduce-scattered to its owners, who keep their reduced gradients; the
        others' are dropped. top-k and PowerSGD all-reduce as ever, then drop (parallel/zero.py says why)."""
        if not reducer.supports_reduce_scatter:
            sent = reducer.reduce(bucket.key, [p.grad for p in bucket.params], self.transport, self.average)
            self.zero.keep_owned(bucket.params, None, self._stream)
            return sent
        if reducer.name == "none" and self.transport.name == "torch" and self._lockstep:
            owned, sent = self.zero.reduce_scatter(bucket.params, self.average)
            self.zero.keep_owned(bucket.params, owned, self._stream)
            return sent
        flat = self.zero.flatten_by_owner(bucket.params)
        owned, sent = reducer.reduce_scatter(bucket.key, flat, self.transport, self.average)
        self.zero.keep_owned(bucket.params, owned, self._stream)
        return sent

    def holds_gradient(self, param: torch.Tensor) -> bool:
        """Whether this rank keeps ``param``'s reduced gradient: always, except under ZeRO-2 for others' parameters."""
        return self.zero_stage < 2 or self.zero.owns(param)

    def synchronize(self) -> None:
        """Launch what backward left (unused parameters) and wait for every reduction."""
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        futures, self._futures = self._futures, []
        if futures:  # without any, nothing ran on the communication stream or each bucket was joined already
            # from the compute stream's end of backward until it may go on: the host's wait for the thread,
            # then, on a GPU, the stream's wait for the communication stream
            with self._pending_stats.wait.timing(), self.probe.span("wait for gradient reductions", "wait"):
                for future in futures:
                    future.result()
                self._stream.join()
        for bucket in self.buckets:
            bucket.ready = 0
        self._passes = dict.fromkeys(self._passes, 0)
        self._next_launch = 0
        self.steps_synchronized += 1
        self.stats, self._pending_stats = self._pending_stats, CommStats(self._device)
        if self.sharded is not None:  # buckets prefetched but unused, or whose gradients never came
            self.sharded.free_all()

    def comm_state_dict(self) -> dict[str, torch.Tensor]:
        """Per-rank state a resumed run needs: the reducer's residuals and warm starts, the velocity of
        the momentum it took over, the step count."""
        steps = torch.tensor(self.steps_synchronized)
        velocity = self._momentum.state_dict() if self._momentum is not None else {}
        return {**self.reducer.state_dict(), **velocity, "steps_synchronized": steps}

    def load_comm_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.steps_synchronized = int(state["steps_synchronized"])
        if self._momentum is not None:
            self._momentum.load_state_dict(state)
        self.reducer.load_state_dict({k: v for k, v in state.items() if k != "steps_synchronized"})

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """For ``step()`` after an explicit ``synchronize()`` (e.g. to clip the reduced gradients)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure=None):
        if not self._skip_sync:
            self.synchronize()
        if self.zero is None:
            return super().step(closure)
        with self.zero.owned_gradients_only():
            loss = super().step(closure)
        if self.zero_stage < 3:  # stage 3 gathers each bucket when the next forward needs it
            with self.probe.collective("parameter all-gather", "zero", self._peers):
                self.zero.gather_parameters()
        return loss

    def holds_parameter(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s values live on this rank between steps: always, except under ZeRO-3 for others' (a
        parameter outside the optimizer, frozen, is whole everywhere)."""
        return self.sharded is None or not self.zero.manages(param) or self.zero.owns(param)

    @contextlib.contextmanager
    def parameters_allocated(self) -> Iterator[None]:
        """Under ZeRO-3, memory for every parameter while inside (to load a checkpoint), others' dropped after."""
        with self.sharded.allocated() if self.sharded is not None else contextlib.nullcontext():
            yield

    def unshard(self) -> None:
        """Collective under ZeRO-3: every parameter whole on every rank again, the gathering hooks removed (after
        the last step); otherwise nothing."""
        if self.sharded is not None:
            self.sharded.unshard()
            self.sharded = None

    def holds_state(self, param: torch.Tensor) -> bool:
        """Whether this rank keeps ``param``'s optimizer state: always, except under ZeRO for others' parameters."""
        return self.zero is None or self.zero.owns(param)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._futures or any(self._passes.values()):
            raise RuntimeError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); with backward_passes_per_step > 1 call step() after the last pass"
            )
        super().zero_grad(set_to_none=set_to_none)
        if self._views is not None:
            self._views.reset()

    def close(self) -> None:
        """Remove the hooks and stop the communication thread."""
        for hook in self._hooks:
            hook.remove()
        if self.sharded is not None:
            self.sharded.remove_hooks()
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    transport: Transport,
    *,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    reducer: Reducer | str = "none",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    backward_passes_per_step: int = 1,
    average: bool = True,
    overlap: bool = True,
    warmup_steps: int = 0,
    probe: Probe | None = None,
    zero: int = 0,
    module: torch.nn.Module | None = None,
    bucket_views: bool = False,
    owned_first: list[torch.nn.Parameter] | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so its gradients are reduced over ``transport``'s group (the DP group).

    ``warmup_steps`` reduce exactly before compression starts: early gradients change
    fastest and compression errors there cost the most (torch's PowerSGD hook does the
    same with ``start_powerSGD_iter``; Deep Gradient Compression ramps its sparsity).
    ``probe`` sees each bucket's reduction (timeline span, stall inspector). ``zero=1`` shards the
    optimizer state over the group (ZeRO stage 1, ``parallel/zero.py``); ``zero=2`` the gradients too,
    each bucket reduce-scattered to its owners; ``zero=3`` the parameters of ``module`` too, each bucket
    gathered by hooks on its modules when forward or backward needs it (call ``unshard()`` after the last step).
    ``bucket_views`` keeps the gradients as views of the buckets (``BucketViews``; ignored at zero >= 2):
    ``zero_grad`` then zeroes them rather than setting them to None. ``owned_first``: parameters the group's
    rank 0 owns under ZeRO whatever their size (tied copies on two pipeline stages: ``parallel.tied``).
    """
    if named_parameters is not None:
        params = [p for _, p in named_parameters if p.requires_grad]
    else:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    base = type(optimizer)
    cls = type(base.__name__, (DistributedOptimizerMixin, base), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks
    wrapped._setup(
        params,
        transport,
        make_reducer(reducer) if isinstance(reducer, str) else reducer,
        bucket_bytes,
        backward_passes_per_step,
        average,
        overlap,
        warmup_steps,
        probe or Probe(),
        zero,
        module,
        bucket_views,
        owned_first,
    )
    return wrapped
