"""Rings over arbitrary lists of global ranks, served by point-to-point messages in one communicator.

HDP splits a long sequence over any k ranks of the HDP domain, a different set every step. A process
group per ring would cost a communicator creation per step (and NCCL memory per group); instead a
`Ring` is a plain list of global ranks of the one HDP group, and `shift` moves a tensor one hop along
it (send to the next member, receive from the previous one) with `torch.distributed.batch_isend_irecv`.

Message matching: messages between two ranks are matched in the order they were posted (gloo per
pair and tag, NCCL per pair), so two ranks that post their exchanges in the same order always pair
the right send with the right receive. The ordering rule that makes several rings deadlock-free is
documented with the ring programs (`megatron_hdp.comm.ring_program`).

Empty tensors are never sent: both sides know every message's size from the same plan, so both skip it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Iterator, Protocol, Sequence

import torch
import torch.distributed as dist

from megatron_hdp.comm import traffic


@dataclasses.dataclass(frozen=True)
class Ring:
    """This process's view of one ring: the members' global ranks in ring order and its own rank."""

    ranks: tuple[int, ...]
    """Global ranks of the members, in ring order (position p sends to position p+1)."""
    rank: int
    """Global rank of this process; must be a member."""
    group: dist.ProcessGroup | None = None
    """Communicator holding every member (None: the default group)."""

    def __post_init__(self) -> None:
        if not self.ranks:
            raise ValueError("a ring needs at least one rank, got an empty rank list")
        if any(not isinstance(r, int) or r < 0 for r in self.ranks):
            raise ValueError(f"ring ranks must be non-negative integers, got {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ring ranks must be distinct, got {list(self.ranks)}")
        if self.rank not in self.ranks:
            raise ValueError(f"rank {self.rank} is not in the ring {list(self.ranks)} it was called with")

    @property
    def size(self) -> int:
        """Number of members."""
        return len(self.ranks)

    @property
    def position(self) -> int:
        """This process's position in the ring (0..size-1)."""
        return self.ranks.index(self.rank)

    @property
    def next_rank(self) -> int:
        """Global rank this process sends to."""
        return self.ranks[(self.position + 1) % self.size]

    @property
    def prev_rank(self) -> int:
        """Global rank this process receives from."""
        return self.ranks[(self.position - 1) % self.size]


def current_ring(ranks: Sequence[int], *, group: dist.ProcessGroup | None = None) -> Ring:
    """The ring over `ranks` (global ranks, ring order) as seen by this process.

    Checks, without any communication, that the ranks are members of `group` (default: the world) and
    that this process is one of them. A ring of one rank works without torch.distributed.
    """
    try:
        ranks = tuple(operator.index(r) for r in ranks)
    except TypeError as err:
        raise ValueError(f"ring ranks must be integers, got {list(ranks)}") from err
    if not dist.is_initialized():
        if len(ranks) > 1:
            raise ValueError(f"a ring of {len(ranks)} ranks {list(ranks)} needs torch.distributed initialized")
        return Ring(ranks=ranks, rank=ranks[0] if ranks else -1, group=group)
    members = set(dist.get_process_group_ranks(group)) if group is not None else None
    world_size = dist.get_world_size()
    for r in ranks:
        if members is not None and r not in members:
            raise ValueError(f"ring rank {r} is not a member of the given group {sorted(members)}")
        if r >= world_size:
            raise ValueError(f"ring rank {r} does not exist in a world of {world_size} ranks")
    return Ring(ranks=ranks, rank=dist.get_rank(), group=group)


class P2PObserver(Protocol):
    """Watches this process's ring messages (the run's telemetry): where bytes go, how long waits take."""

    def sent(self, *, peer: int, num_bytes: int) -> None:
        """`num_bytes` were posted to global rank `peer`."""

    def waiting(self) -> contextlib.AbstractContextManager:
        """A context around one wait for posted messages."""


_OBSERVERS: list[P2PObserver] = []


@contextlib.contextmanager
def observe_p2p(observer: P2PObserver) -> Iterator[P2PObserver]:
    """Let `observer` see every `shift` and every wait inside the block."""
    _OBSERVERS.append(observer)
    try:
        yield observer
    finally:
        _OBSERVERS.remove(observer)


class Pending:
    """Posted sends and receives; `wait()` returns once all of them are complete.

    Holds the tensors until then, so that no buffer in flight is freed by its owner dropping it.
    """

    def __init__(self, works: list[dist.Work], tensors: tuple[torch.Tensor, ...] = ()) -> None:
        self._works = works
        self._tensors = tensors

    def wait(self) -> None:
        """Block until the exchange is complete (on CUDA: until the current stream is ordered after it)."""
        with contextlib.ExitStack() as waits:
            for observer in _OBSERVERS if self._works else ():
                waits.enter_context(observer.waiting())
            for work in self._works:
                work.wait()
        self._works = []
        self._tensors = ()


def shift(ring: Ring, *, send: torch.Tensor, recv: torch.Tensor, hops: int = 1) -> Pending:
    """Post `send` to the member `hops` positions ahead and a receive into `recv` from the member `hops`
    behind (default: next and previous); do not wait. An empty `send` or `recv` posts nothing for it.

    One `batch_isend_irecv` call (an NCCL group on GPU). `send` must not be modified and `recv` not
    read until `wait()` returns. A ring of one posts nothing.
    """
    if ring.size == 1:
        return Pending([])
    to_rank = ring.ranks[(ring.position + hops) % ring.size]
    from_rank = ring.ranks[(ring.position - hops) % ring.size]
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer=to_rank, group=ring.group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer=from_rank, group=ring.group))
    traffic.record(
        bytes_sent=send.numel() * send.element_size(),
        bytes_received=recv.numel() * recv.element_size(),
        num_sent=int(send.numel() > 0),
        num_received=int(recv.numel() > 0),
    )
    for observer in _OBSERVERS:
        observer.sent(peer=to_rank, num_bytes=send.numel() * send.element_size())
    return Pending(dist.batch_isend_irecv(ops) if ops else [], (send, recv))
