"""Ring programs: an algorithm for one ring member written once, run over P2P or k-at-a-time in one process.

A ring program is a generator that yields communication requests and finally returns its result:

* `Post(send, recv, hops)` — start sending `send` to the member `hops` positions ahead (default 1: the
  next) and receiving `recv` from the member `hops` behind; an empty tensor posts nothing for its side
  (the peer's matching side is empty too); the program goes on computing (this is where communication
  overlaps computation);
* `WAIT` — block until the oldest posted exchange not yet waited for is complete.

Every member of a ring runs the same program shape (the sequence of posts and waits depends only on the
ring size), so the requests of all members line up one to one. Two drivers serve them:

* `run_on_ring(program, ring)` — this process is one member; each `Post` is one `batch_isend_irecv`
  in the HDP communicator (`megatron_hdp.comm.p2p.shift`).
* `run_in_process(programs)` — all k members in this process, advanced in lockstep; a `WAIT` copies
  each member's oldest send into the next member's receive buffer. Tests use it to check the ring math
  without processes, and the single-GPU benchmark to time the ring's decomposition of the work.

Deadlock freedom (the ordering rule)
-----------------------------------
Within one ring, a member posts both directions of a step before it waits, so no two members of a ring
wait on each other. Across rings — a rank in several rings of one micro-batch, rings of different ranks
sharing members — it is enough that **every rank runs its rings in one global order**: the runtime calls
the forward of its rings in ascending order of the ring's smallest sequence id. Argument: take, among the
ranks that are blocked, one whose current ring R comes first in the global order. Every other member of
R has either not reached R yet — it is then busy with an earlier ring, which cannot block (R is the
earliest ring anyone is blocked in) so it arrives — or is in R; the members of R then complete R's steps
together, so nobody stays blocked. Message matching is safe too: two ranks post the messages they
exchange in the same order (same rings in the same order, same program shape), and both gloo and NCCL
match the messages of a pair in posting order (a `Post` with `hops` != 1 pairs p with p + hops; both
sides post it at the same exchange of the same program shape, an empty side on both or neither, as the
plans of all members agree). Backward passes run the rings in the reverse global
order: autograd runs ready nodes of one device highest sequence number first, and a ring's backward
never waits for an earlier ring's backward, so every rank takes its rings' backwards in descending key
order, again one global order. (A runtime that re-runs forwards in backward, activation recompute,
keeps the rule as long as it re-runs one layer's rings in ascending order.)
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Generator, Sequence, TypeVar, Union

import torch

from megatron_hdp.comm.p2p import Pending, Ring, shift

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Post:
    """Start sending `send` to the member `hops` ahead and receiving into `recv` from the one `hops` behind."""

    send: torch.Tensor
    recv: torch.Tensor
    hops: int = 1


class Wait:
    """Block until the oldest posted, not yet waited-for exchange is complete."""

    def __repr__(self) -> str:
        return "WAIT"


WAIT = Wait()

Request = Union[Post, Wait]
RingProgram = Generator[Request, None, T]


def run_on_ring(program: RingProgram[T], ring: Ring) -> T:
    """Run one member's program with real point-to-point messages; return its result."""
    pending: collections.deque[Pending] = collections.deque()
    try:
        request = next(program)
        while True:
            if isinstance(request, Post):
                pending.append(shift(ring, send=request.send, recv=request.recv, hops=request.hops))
            else:
                pending.popleft().wait()
            request = next(program)
    except StopIteration as stop:
        assert not pending, f"ring program ended with {len(pending)} exchanges never waited for"
        return stop.value


def run_in_process(programs: Sequence[RingProgram[T]]) -> list[T]:
    """Run the programs of all k members of one ring (index = ring position) in lockstep; their results.

    A member's receive is filled from the send, in the same exchange, of the position `hops` behind; nothing leaves
    the process and no bytes are counted.
    """
    num_members = len(programs)
    posted: list[collections.deque[Post]] = [collections.deque() for _ in range(num_members)]
    results: list[T] = [None] * num_members  # type: ignore[list-item]
    done = [False] * num_members

    def advance(position: int) -> None:
        """Run one member until its next WAIT (or its end), collecting its posts."""
        program = programs[position]
        try:
            request = next(program)
            while isinstance(request, Post):
                posted[position].append(request)
                request = next(program)
        except StopIteration as stop:
            results[position] = stop.value
            done[position] = True

    for position in range(num_members):
        advance(position)
    while not all(done):
        assert not any(done), "ring programs of one ring went out of step"
        oldest = [queue.popleft() for queue in posted]
        for position, post in enumerate(oldest):
            send = oldest[(position - post.hops) % num_members].send
            assert post.recv.shape == send.shape, (
                f"position {position} receives {tuple(post.recv.shape)}, sent {tuple(send.shape)}"
            )
            post.recv.copy_(send)
        for position in range(num_members):
            advance(position)
    assert not any(posted), "ring programs ended with exchanges never waited for"
    return results
