"""Pipeline-parallel schedules as pure data: built, checked and simulated without processes.

A schedule is one list of actions per pipeline rank, run in order. Stages are numbered
globally: with p ranks and v model chunks per rank there are S = p*v stages, and stage s
is chunk s // p of rank s % p (Megatron's interleaving), so a microbatch passes through
the ranks v times. An activation goes from stage s to s+1, its gradient from s+1 back to
s. Between stages on different ranks that is an explicit SEND on one rank and RECV on the
other; between stages on the same rank (only when p == 1) the tensor is handed over
locally and the schedule holds no action for it.

The model of execution, shared by ``simulate`` and the executor in ``parallel.pipeline``:
sends never block (Gloo's isend), receives block until the message is there. A message
is named by ``Message`` (direction, microbatch, receiving stage), which the executor turns
into its tag, so matching never depends on arrival order; ``validate`` still checks that
each channel's sends and receives come in the same order, which a transport matching by
order (NCCL) would need.

Bubble definition, used by the simulator and the theory alike: on each rank,
idle time / makespan, where busy time is the F and B compute only; the schedule's bubble
is the mean over ranks. With F and B of equal cost and no communication time that is
exactly (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v*m+p-1) for interleaved 1F1B.

We write the schedules here rather than reuse torch.distributed.pipelining because its
action lists (``_Action``, ``pipeline_order``) and its simulator are private and change
between releases; here they are plain frozen dataclasses we can test, print and simulate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from hpc.errors import ConfigError, HpcError, LayoutError

Kind = Literal["F", "B", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
Direction = Literal["F", "B"]
ScheduleName = Literal["gpipe", "1f1b", "interleaved"]
Schedule = list[list["Action"]]


class ScheduleError(HpcError):
    """A schedule is malformed: an action out of place, a send without its receive, a stage twice."""


class DeadlockError(ScheduleError):
    """Simulating a schedule reached a point where every unfinished rank waits for a message."""


@dataclass(frozen=True)
class Action:
    """One step of one rank. ``stage`` is the global stage computed, or whose input (RECV_F),
    output (SEND_F), output gradient (RECV_B) or input gradient (SEND_B) travels; ``peer`` is
    the pipeline rank on the other end of a send or receive."""

    kind: Kind
    microbatch: int
    stage: int
    peer: int | None = None

    @property
    def is_compute(self) -> bool:
        return self.kind in ("F", "B")

    @property
    def message(self) -> Message | None:
        """The message a send delivers or a receive waits for; None for compute."""
        if self.kind in ("SEND_F", "SEND_B"):
            direction = self.kind[-1]
            return Message(direction, self.microbatch, self.stage + (1 if direction == "F" else -1))
        if self.kind in ("RECV_F", "RECV_B"):
            return Message(self.kind[-1], self.microbatch, self.stage)
        return None

    def __str__(self) -> str:
        peer = "" if self.peer is None else (f"->r{self.peer}" if self.kind.startswith("SEND") else f"<-r{self.peer}")
        return f"{self.kind}(mb{self.microbatch},s{self.stage}){peer}"


@dataclass(frozen=True)
class Message:
    """An activation (F) or gradient (B) of one microbatch, named by the stage that consumes it."""

    direction: Direction
    microbatch: int
    stage: int


@dataclass(frozen=True)
class Interval:
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    timelines: list[list[Interval]]  # per rank; a RECV's interval is the time spent waiting
    makespan: float
    busy: list[float]  # per rank: F and B compute time
    bubble: float  # mean over ranks of (makespan - busy) / makespan
    peak_in_flight: list[int]  # per rank: most microbatch-chunks forwarded but not yet backwarded


def stage_bounds(num_layers: int, p: int, v: int = 1) -> list[tuple[int, int]]:
    """``[start, stop)`` layer ranges of the p*v stages, contiguous and of equal size."""
    stages = p * v
    if p < 1 or v < 1 or num_layers < 1 or num_layers % stages:
        raise LayoutError(
            f"{num_layers} layers cannot be cut into pp*virtual_stages = {p}*{v} = {stages} equal stages",
            layers=num_layers, pp=p, virtual_stages=v,
        )
    size = num_layers // stages
    return [(s * size, (s + 1) * size) for s in range(stages)]


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards: every rank holds all m microbatches at once."""
    _check_sizes(p, m, 1)
    return _with_messages([[("F", i, r) for i in range(m)] + [("B", i, r) for i in range(m)] for r in range(p)], p, 1)


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush: rank r runs p-r-1 warm-up forwards, then alternates, so at most p-r are in flight."""
    _check_sizes(p, m, 1)
    orders = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [("F", i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [("F", warmup + i, r), ("B", i, r)]
        orders.append(order + [("B", i, r) for i in range(m - warmup, m)])
    return _with_messages(orders, p, 1)


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: each rank runs v chunks, microbatches move in groups of p.

    Every rank visits (microbatch, chunk) pairs in the same order: p microbatches through
    chunk 0, the same p through chunk 1, ..., then the next p microbatches (backwards run
    the chunks in reverse). Rank r warms up with 2*(p-r-1) + (v-1)*p forwards, Megatron's count:
    with each tick's messages posted as one batch (``ticks``), rank r's t-th batch then meets
    rank r+1's (t-1)-th in both directions, which is what lets NCCL's in-order queues move
    (``lockstep_deadlock``); one forward per rank fewer deadlocks them once m > p. The price is
    up to p-1 more microbatch-chunks in flight on the first ranks.
    """
    _check_sizes(p, m, v)
    if m % p:
        raise ConfigError(
            f"interleaved 1F1B needs the microbatches to be a multiple of the pipeline stages: "
            f"{m} % {p} = {m % p}",
            microbatches=m, pp=p,
        )
    total = m * v

    def visit(k: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        return group * p + within % p, chunk if forward else v - 1 - chunk

    orders = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)

        def step(kind: Direction, k: int, rank: int = r) -> tuple[Direction, int, int]:
            microbatch, chunk = visit(k, kind == "F")
            return kind, microbatch, chunk * p + rank

        order = [step("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [step("F", warmup + k), step("B", k)]
        orders.append(order + [step("B", k) for k in range(total - warmup, total)])
    return _with_messages(orders, p, v)


BUILDERS: dict[str, Callable[..., Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def build_schedule(name: ScheduleName, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule by its config name (``parallel.schedule``); only interleaved takes v > 1."""
    if name not in BUILDERS:
        raise ConfigError(f"unknown pipeline schedule {name!r} (valid: {', '.join(BUILDERS)})")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if v != 1:
        raise ConfigError(f"virtual_stages={v} needs schedule='interleaved', got {name!r}", virtual_stages=v)
    return BUILDERS[name](p, m)


def theoretical_bubble(name: ScheduleName, p: int, m: int, v: int = 1) -> float:
    """(p-1)/(v*m+p-1): the fill and drain of p-1 chunk-steps against v*m chunk-steps of work."""
    return (p - 1) / ((v if name == "interleaved" else 1) * m + p - 1)


def validate(schedule: Sequence[Sequence[Action]]) -> None:
    """Raise ScheduleError unless every stage runs F then B once per microbatch on its own rank,
    and every send meets exactly one receive, with each channel's order the same on both ends."""
    p = len(schedule)
    seen: set[tuple[str, int, int]] = set()
    sends: dict[tuple[int, int, str], list[Message]] = defaultdict(list)
    receives: dict[tuple[int, int, str], list[Message]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for action in actions:
            where = {"rank": rank, "action": str(action)}
            if action.stage < 0 or action.microbatch < 0:
                raise ScheduleError("negative stage or microbatch", **where)
            if action.stage % p != rank:
                raise ScheduleError(f"stage {action.stage} belongs to rank {action.stage % p}", **where)
            if action.is_compute:
                key = (action.kind, action.microbatch, action.stage)
                if key in seen:
                    raise ScheduleError("computed twice", **where)
                if action.kind == "B" and ("F", action.microbatch, action.stage) not in seen:
                    raise ScheduleError("backward before its forward", **where)
                seen.add(key)
                continue
            direction = action.kind[-1]
            neighbour = action.stage + (1 if (direction == "F") == action.kind.startswith("SEND") else -1)
            if p == 1 or action.peer != neighbour % p:
                raise ScheduleError(f"peer must be rank {neighbour % p}, the rank of stage {neighbour}", **where)
            if action.kind.startswith("SEND"):
                if (direction, action.microbatch, action.stage) not in seen:
                    raise ScheduleError("sent before it was computed", **where)
                sends[(rank, action.peer, direction)].append(action.message)
            else:
                receives[(action.peer, rank, direction)].append(action.message)
    m, num_stages = (1 + max((key[i] for key in seen), default=-1) for i in (1, 2))
    missing = sorted({(kind, mb, s) for kind in "FB" for mb in range(m) for s in range(num_stages)} - seen)
    if missing:
        kind, mb, stage = missing[0]
        raise ScheduleError(f"{len(missing)} computations are missing, first {kind} of microbatch {mb} "
                            f"on stage {stage}")
    for channel in sorted(set(sends) | set(receives)):
        if sends[channel] != receives[channel]:
            src, dst, direction = channel
            raise ScheduleError(
                f"{direction} messages from rank {src} to rank {dst} are sent as {_names(sends[channel])} "
                f"but received as {_names(receives[channel])}"
            )


def simulate(
    schedule: Sequence[Sequence[Action]], forward_time: float = 1.0, backward_time: float = 2.0,
    comm_time: float = 0.0,
) -> Simulation:
    """Run a validated schedule as an event simulation: compute takes its cost, a send
    arrives ``comm_time`` later without blocking its sender, a receive waits for arrival.

    Ranks advance in any order until each is done or blocked; the times do not depend on
    that order because a rank's clock depends only on its own actions and its messages.
    """
    validate(schedule)
    p = len(schedule)
    num_stages = 1 + max((a.stage for actions in schedule for a in actions), default=0)
    clock, position = [0.0] * p, [0] * p
    busy, in_flight, peak = [0.0] * p, [0] * p, [0] * p
    timelines: list[list[Interval]] = [[] for _ in range(p)]
    network: dict[Message, float] = {}
    inbox: list[set[Message]] = [set() for _ in range(p)]
    cost = {"F": forward_time, "B": backward_time}

    def blocked_on(rank: int, action: Action) -> Message | None:
        """The message this action still waits for, or None when it can run now."""
        if action.kind in ("RECV_F", "RECV_B"):
            return None if action.message in network else action.message
        needed = _input_of(action, num_stages)
        return needed if needed is not None and needed not in inbox[rank] else None

    progressed = True
    while progressed:
        progressed = False
        for rank, actions in enumerate(schedule):
            while position[rank] < len(actions) and blocked_on(rank, action := actions[position[rank]]) is None:
                start = clock[rank]
                if action.kind in ("RECV_F", "RECV_B"):
                    clock[rank] = max(start, network.pop(action.message))
                    inbox[rank].add(action.message)
                elif action.kind in ("SEND_F", "SEND_B"):
                    network[action.message] = start + comm_time
                else:
                    inbox[rank].discard(_input_of(action, num_stages))
                    clock[rank] += cost[action.kind]
                    busy[rank] += cost[action.kind]
                    in_flight[rank] += 1 if action.kind == "F" else -1
                    peak[rank] = max(peak[rank], in_flight[rank])
                    output = _output_of(action, num_stages)
                    if output is not None and p == 1:  # the next stage is on this rank: a local hand-over
                        inbox[rank].add(output)
                timelines[rank].append(Interval(start, clock[rank], action))
                position[rank] += 1
                progressed = True
    stuck = {r: actions[position[r]] for r, actions in enumerate(schedule) if position[r] < len(actions)}
    if stuck:
        waits = "; ".join(f"rank {r} at {a} waits for {blocked_on(r, a)}" for r, a in stuck.items())
        raise DeadlockError(f"deadlock: {waits}", stuck_ranks=sorted(stuck))
    makespan = max(clock, default=0.0)
    bubble = sum(1 - b / makespan for b in busy) / p if makespan else 0.0
    return Simulation(timelines, makespan, busy, bubble, peak)


def _input_of(action: Action, num_stages: int) -> Message | None:
    """What a compute action consumes besides its own stash: the activation or the output gradient."""
    if action.kind == "F" and action.stage > 0:
        return Message("F", action.microbatch, action.stage)
    if action.kind == "B" and action.stage < num_stages - 1:
        return Message("B", action.microbatch, action.stage)
    return None


def _output_of(action: Action, num_stages: int) -> Message | None:
    if action.kind == "F" and action.stage < num_stages - 1:
        return Message("F", action.microbatch, action.stage + 1)
    if action.kind == "B" and action.stage > 0:
        return Message("B", action.microbatch, action.stage - 1)
    return None


def _check_sizes(p: int, m: int, v: int) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ConfigError(f"pipeline sizes must be >= 1: stages={p}, microbatches={m}, virtual_stages={v}")


def _with_messages(orders: list[list[tuple[Direction, int, int]]], p: int, v: int) -> Schedule:
    """Compute orders -> actions: a RECV before each compute whose input is on another rank,
    a SEND after each compute whose output goes to another rank (every neighbour, when p > 1)."""
    last = p * v - 1
    schedule = []
    for order in orders:
        actions = []
        for kind, microbatch, stage in order:
            upstream, downstream = (stage - 1, stage + 1) if kind == "F" else (stage + 1, stage - 1)
            if p > 1 and 0 <= upstream <= last:
                actions.append(Action(f"RECV_{kind}", microbatch, stage, upstream % p))
            actions.append(Action(kind, microbatch, stage))
            if p > 1 and 0 <= downstream <= last:
                actions.append(Action(f"SEND_{kind}", microbatch, stage, downstream % p))
        schedule.append(actions)
    return schedule


def _names(messages: list[Message]) -> str:
    shown = ", ".join(f"mb{m.microbatch}->s{m.stage}" for m in messages[:4])
    return f"[{shown}{', ...' if len(messages) > 4 else ''}]"


@dataclass(frozen=True)
class Tick:
    """A rank's computes that run back to back (a forward, a backward, or the steady state's forward then
    backward), then ``posts``: one batch of the sends of their outputs and the receives of the next tick's
    inputs (Megatron's batched point-to-point). A rank's first tick has no computes: its batch holds the
    receives of the first real tick's inputs."""

    computes: tuple[Action, ...]
    posts: tuple[Action, ...]


def ticks(actions: Sequence[Action]) -> list[Tick]:
    """One rank's actions as ticks. With one chunk a rank (GPipe, 1F1B) a tick is one compute, Megatron's
    ``send_forward_recv_backward`` and ``send_backward_recv_forward``; with several (interleaved) the warm-up
    forwards are one a tick, then forward and backward pairs, then the cool-down backwards one a tick (any
    schedule built here is warm-up, pairs, cool-down), as Megatron's interleaved schedule batches them: split
    into one batch per compute, NCCL's queues deadlock it (``lockstep_deadlock``)."""
    units: list[tuple[Action | None, Action, Action | None]] = []  # (receive of its input, compute, send)
    receive: Action | None = None
    for action in actions:
        if action.kind in ("RECV_F", "RECV_B"):
            receive = action
        elif action.is_compute:
            units.append((receive, action, None))
            receive = None
        else:
            units[-1] = (*units[-1][:2], action)
    kinds = [compute.kind for _, compute, _ in units]
    forwards = kinds.count("F")
    before_backward = kinds.index("B") if "B" in kinds else forwards
    warmup = forwards if before_backward == forwards else before_backward - 1
    if len({compute.stage for _, compute, _ in units}) == 1:
        warmup = forwards  # one chunk: every compute its own tick
    sizes = [1] * warmup + [2] * (forwards - warmup) + [1] * (len(units) - 2 * forwards + warmup)
    groups, start = [], 0
    for size in sizes:
        groups.append(units[start:start + size])
        start += size
    result = [Tick((), tuple(r for r, _, _ in groups[0] if r is not None))] if groups else []
    for index, group in enumerate(groups):
        following = groups[index + 1] if index + 1 < len(groups) else []
        posts = [s for _, _, s in group if s is not None] + [r for r, _, _ in following if r is not None]
        result.append(Tick(tuple(c for _, c, _ in group), tuple(posts)))
    return result


def lockstep_deadlock(schedule: Sequence[Sequence[Action]]) -> str | None:
    """Why the schedule, posted as ``ticks``, would hang or mix up messages on NCCL, or None when it runs.

    NCCL's rules, as the executor meets them: each rank's batches run one after another on the group's one
    queue; a batch finishes once each of its messages met its match in the peer's running batch; the k-th
    message from one rank to another meets the k-th receive the other posted from it (tags ignored, so it
    must be the same message); a rank waits for a tick's inputs before computing it, and for everything at
    the end.
    """
    p = len(schedule)
    plans = [ticks(actions) for actions in schedule]
    state = _Lockstep(p)
    position = [0] * p
    while True:
        progressed = False
        for rank, plan in enumerate(plans):
            while position[rank] < len(plan) and state.inputs_arrived(rank, plan[position[rank] - 1]
                                                                       if position[rank] else None):
                state.post(rank, plan[position[rank]].posts)
                position[rank] += 1
                progressed = True
        mixed, moved = state.match()
        if mixed:
            return mixed
        if all(position[r] == len(plans[r]) for r in range(p)) and state.drained():
            return None
        if not (progressed or moved):
            return "every rank waits: " + "; ".join(state.describe(r, plans[r], position[r]) for r in range(p))


class _Lockstep:
    """Posted batches per rank, matched as NCCL matches them (see ``lockstep_deadlock``)."""

    def __init__(self, p: int) -> None:
        self.queues: list[list[list[list]]] = [[] for _ in range(p)]  # rank -> batches -> [action, key, done]
        self.counts: dict[tuple[int, int, bool], int] = defaultdict(int)
        self.arrived: list[set[Message]] = [set() for _ in range(p)]

    def post(self, rank: int, posts: Sequence[Action]) -> None:
        batch = []
        for action in posts:
            sending = action.kind.startswith("SEND")
            channel = (rank, action.peer) if sending else (action.peer, rank)
            batch.append([action, (*channel, self.counts[(*channel, sending)]), False])
            self.counts[(*channel, sending)] += 1
        if batch:
            self.queues[rank].append(batch)

    def inputs_arrived(self, rank: int, previous: Tick | None) -> bool:
        """Whether the receives the previous tick posted (this tick's inputs) have arrived."""
        return previous is None or all(action.message in self.arrived[rank] for action in previous.posts
                                       if action.kind in ("RECV_F", "RECV_B"))

    def match(self) -> tuple[str | None, bool]:
        moved = False
        for rank, queue in enumerate(self.queues):
            if not queue:
                continue
            for op in queue[0]:
                action, key, done = op
                if done or not action.kind.startswith("SEND"):
                    continue
                peer_queue = self.queues[action.peer]
                match = next((o for o in (peer_queue[0] if peer_queue else []) if not o[2] and o[1] == key
                              and o[0].kind.startswith("RECV")), None)
                if match is None:
                    continue
                if match[0].message != action.message:
                    return (f"rank {action.peer} receives {match[0]} where rank {rank} sends {action}: NCCL matches "
                            "messages in order, not by tag"), moved
                op[2] = match[2] = moved = True
        for rank, queue in enumerate(self.queues):
            while queue and all(op[2] for op in queue[0]):
                for op in queue.pop(0):
                    if op[0].kind.startswith("RECV"):
                        self.arrived[rank].add(op[0].message)
                moved = True
        return None, moved

    def drained(self) -> bool:
        return not any(self.queues)

    def describe(self, rank: int, plan: Sequence[Tick], position: int) -> str:
        running = self.queues[rank][0] if self.queues[rank] else []
        waiting = [str(op[0]) for op in running if not op[2]]
        at = "the end" if position == len(plan) else " ".join(str(c) for c in plan[position].computes)
        return f"rank {rank} before {at}, its running batch waits on {', '.join(waiting) or 'nothing'}"
