"""The hierarchical exchange's node stages on the host, through memory the node's ranks share.

Gloo, which carries the host's tensors, moves every byte between two ranks of one host through a loopback
TCP socket: 8 MB cost each side about 6 ms of CPU here, where copying them takes 1.2 ms. MPI (its shared-memory
transport) and NCCL (its SHM transport) move such bytes through shared memory; Gloo has none, and torch offers
none for process groups. So on the host the node's reduce-scatter and all-gather read and write the node's
ranks' segments directly, and Gloo carries only a barrier per stage:

- each rank maps a file of its own in /dev/shm, sized to the largest bucket seen, and every other rank of its
  node maps it too; the files are unlinked as soon as all have mapped them, so a rank killed later leaves
  nothing behind;
- reduce-scatter: each rank writes the chunks the others own into its segment, a barrier, then it sums its own
  chunk from theirs in the ring's order (``parallel/ring.py``: chunk c's sum starts on rank c and each next
  rank adds its part), so the sums equal the ring's bit for bit;
- all-gather: each rank writes its reduced chunk into its segment, a barrier, then it copies the others';
- two sets of segments alternate between calls: a rank writes the next call's chunks into one set while a
  slower rank still reads the other, and the next call's barrier orders them.

Ranks the launcher puts on one node may still not share /dev/shm (a container per rank, or no /dev/shm at all):
``attach`` checks that every rank reads what each other wrote and agrees on the answer with one all-reduce,
and the node keeps the ring (over Gloo) where they do not.
"""

from __future__ import annotations

import os
import secrets
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

SHARED_DIR = "/dev/shm"


class NodeSharedMemory:
    """One node group's segments (``attach`` makes it); every method is collective over the node's ranks."""

    def __init__(self, group: ProcessGroup, local_rank: int, local_size: int, name: str) -> None:
        self.group, self.local_rank, self.local_size, self.name = group, local_rank, local_size, name
        self.capacity, self.generation, self.flip = 0, 0, 0
        self.sets: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])

    @classmethod
    def attach(cls, group: ProcessGroup, local_rank: int, local_size: int, nbytes: int) -> NodeSharedMemory | None:
        """Collective over the node: its shared memory with segments of ``nbytes``, or None on every rank if
        any rank cannot map the others' segments."""
        name = torch.zeros(16, dtype=torch.uint8, device="cpu")  # the node group carries host tensors (Gloo)
        if local_rank == 0:
            name.copy_(torch.frombuffer(bytearray(secrets.token_bytes(16)), dtype=torch.uint8))
        dist.broadcast(name, src=dist.get_global_rank(group, 0), group=group)
        memory = cls(group, local_rank, local_size, f"hpc-{bytes(name.tolist()).hex()}")
        return memory if memory._grow(nbytes) else None

    def reduce_scatter(self, padded: torch.Tensor) -> torch.Tensor:
        """The node's sum of chunk ``(local_rank + 1) % g`` of ``padded`` (g equal chunks), in place; returns
        that chunk's view, as ``ring_reduce_scatter`` does."""
        g, me = self.local_size, self.local_rank
        self.flip ^= 1
        segments = self._segments(padded)
        chunks, mine = padded.view(g, -1), (me + 1) % g
        for chunk in range(g):
            if chunk != mine:
                segments[me][chunk].copy_(chunks[chunk])
        dist.barrier(group=self.group)
        # the ring's order: rank `mine` starts the sum, each next rank adds its part, this rank last; only this
        # rank reads chunk `mine` of the others' segments, so the partial sum builds up in the first of them
        ranks = [(mine + step) % g for step in range(g - 1)]
        partial = segments[ranks[0]][mine]
        for rank in ranks[1:]:
            partial.add_(segments[rank][mine])
        return chunks[mine].add_(partial)

    def all_gather(self, padded: torch.Tensor, shard: torch.Tensor) -> None:
        """``padded`` made of every rank's ``shard``, rank r's in chunk ``(r + 1) % g``, after
        :meth:`reduce_scatter` (whose segments it reuses)."""
        g, me = self.local_size, self.local_rank
        segments = self._segments(padded)
        segments[me][(me + 1) % g].copy_(shard)
        dist.barrier(group=self.group)
        chunks = padded.view(g, -1)
        for rank in range(g):
            if rank != me:
                chunks[(rank + 1) % g].copy_(segments[rank][(rank + 1) % g])

    def _segments(self, padded: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's segment of the current set, as ``padded``'s g chunks (the same bucket sizes come in the
        same order on every rank, so all grow together)."""
        if padded.nbytes > self.capacity and not self._grow(padded.nbytes):
            raise RuntimeError(f"the node's ranks could no longer map each other's segments in {SHARED_DIR}")
        return [raw[: padded.nbytes].view(padded.dtype).view(self.local_size, -1) for raw in self.sets[self.flip]]

    def _grow(self, nbytes: int) -> bool:
        """New segments of ``nbytes`` (both sets), mapped by every rank of the node and their files unlinked;
        whether every rank read each other's token in them (the same answer on every rank)."""
        nbytes, self.generation = max(nbytes, 64), self.generation + 1
        paths = [[os.path.join(SHARED_DIR, f"{self.name}-{self.generation}-{flip}-{rank}")
                  for rank in range(self.local_size)] for flip in (0, 1)]
        token = torch.tensor(list(self.local_rank.to_bytes(8, "little")), dtype=torch.uint8, device="cpu")
        mine: list[torch.Tensor] = []
        try:
            for flip in (0, 1):
                mine.append(torch.from_file(paths[flip][self.local_rank], shared=True, size=nbytes, dtype=torch.uint8))
                mine[-1][:8] = token
        except (OSError, RuntimeError):  # no /dev/shm, or full
            pass
        dist.barrier(group=self.group)
        sets = None
        if len(mine) == 2:
            sets = tuple([mine[flip] if rank == self.local_rank else _map(paths[flip][rank], nbytes, rank)
                          for rank in range(self.local_size)] for flip in (0, 1))
        mapped = sets is not None and all(segment is not None for flip in sets for segment in flip)
        everyone = torch.tensor([int(mapped)], device="cpu")
        dist.all_reduce(everyone, op=dist.ReduceOp.MIN, group=self.group)  # also: every rank has mapped them
        for flip in range(len(mine)):
            os.unlink(paths[flip][self.local_rank])
        if not everyone.item():
            return False
        self.sets, self.capacity = sets, nbytes
        return True


def _map(path: str, nbytes: int, rank: int) -> torch.Tensor | None:
    """Another rank's segment, or None where this rank does not see the file it wrote (another /dev/shm)."""
    try:
        if os.path.getsize(path) != nbytes:
            return None
        segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    except (OSError, RuntimeError):
        return None
    return segment if int.from_bytes(bytes(segment[:8].tolist()), "little") == rank else None
