"""StepPlan: who holds which tokens of which sequence in which micro-batch, for one training step.

The JSON form (`to_dict`) is the contract of docs/architecture.md; the planner, the simulator, the sampler and the
runtime all read this one object. A plan is frozen data and checks itself (`validate`): every token held
exactly once, rings consistent with the zigzag layout, capacities respected, ring members aligned on one
micro-batch index (ring attention needs all members in the same micro-batch at the same time).
"""

from __future__ import annotations

import hashlib
import json
from collections import deque
from dataclasses import dataclass, field, fields
from itertools import chain, repeat
from typing import Any, Optional, Sequence, TypeVar

import numpy as np

from megatron_hdp.plan.zigzag import Interval, zigzag_chunk_bounds, zigzag_chunks

PLAN_VERSION = 1

_Plain = TypeVar("_Plain")


def _as_tuples(chunks) -> tuple[Interval, ...]:
    """Chunks as a tuple of (start, end) tuples, whatever sequence types they were built from."""
    return tuple(tuple(c) for c in chunks)


# A 32M-token plan holds ~35K shards and sequence placements, so the four classes below are slotted (no
# per-instance __dict__: less memory, one GC-tracked object per instance instead of two) and compute their
# token counts on demand instead of caching them; `build_many` builds many of them at once.
@dataclass(frozen=True, slots=True)
class Shard:
    """The token intervals of one sequence that one rank holds in one micro-batch."""

    seq: int
    chunks: tuple[Interval, ...]

    @property
    def num_tokens(self) -> int:
        return sum(end - start for start, end in self.chunks)


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """Shards one rank runs together in one forward/backward pass."""

    shards: tuple[Shard, ...]
    capacity: int
    est_time: float = 0.0

    @property
    def num_tokens(self) -> int:
        return sum(shard.num_tokens for shard in self.shards)


@dataclass(frozen=True, slots=True)
class RankSchedule:
    """One HDP rank's micro-batches, in execution order."""

    rank: int
    microbatches: tuple[MicroBatch, ...]
    est_time: float = 0.0


@dataclass(frozen=True, slots=True)
class SequencePlacement:
    """Where one sequence of the global batch lives: its ring (one rank when whole), offload ratio and the
    kind of ring it runs ("kv": K and V circulate; "latent": multi-latent attention's latent does, every
    member up-projecting it). Sequences on one ring in one micro-batch share one ring call, hence a kind;
    a whole sequence is "kv" (no ring). In the JSON as "ring_kind" only when "latent"."""

    id: int
    length: int
    ring: tuple[int, ...]
    offload_ratio: float = 0.0
    ring_kind: str = "kv"


def build_many(cls: type[_Plain], *columns: Sequence[Any]) -> list[_Plain]:
    """Instances of the slotted plan class `cls` built column by column: `columns[i]` holds every
    instance's value of field i, in field order (every field given, no defaults).

    What unpickling does — object.__new__, then each field stored through its slot — done as C-level
    passes over the columns: ~1.4x faster than calling the class, whose frozen __init__ routes every
    field through object.__setattr__ in Python. The instances are the same (equal, frozen, hashable);
    like the constructor, nothing is validated here.
    """
    assert "__slots__" in cls.__dict__, f"{cls.__name__} is not a slotted dataclass"
    names = [f.name for f in fields(cls)]
    assert len(columns) == len(names), f"{cls.__name__} has fields {names}, got {len(columns)} columns"
    count = len(columns[0])
    instances = list(map(object.__new__, repeat(cls, count)))
    for name, column in zip(names, columns):
        assert len(column) == count, f"column {name} has {len(column)} values, not {count}"
        deque(map(getattr(cls, name).__set__, instances, column), maxlen=0)
    return instances


@dataclass(frozen=True)
class PlanSummary:
    """Statistics of one plan, for logs, tables and the step statistics."""

    num_sequences: int
    num_tokens: int
    num_rings: int
    ring_sizes: dict[int, int]
    max_microbatches: int
    min_microbatches: int
    est_step_time: float
    balance: float
    """max / mean of the predicted per-rank times (1.0 is perfect balance)."""
    attention_bytes: float
    """Ring-attention bytes sent by all ranks in the step (0 when no cost model was given)."""
    rings_across_nodes: int = 0
    """Rings whose ranks sit on more than one node (the cost model's `ranks_per_node`; 0 without one)."""
    network_bytes: float = 0.0
    """Of `attention_bytes`, those sent over links between nodes (ring hops from one node to another)."""
    latent_rings: int = 0
    """Rings that circulate multi-latent attention's latent instead of K and V (`ring_kind` "latent")."""


def _validate_sequence(seq: SequencePlacement, held: list[tuple[int, int, Shard]]) -> None:
    """Check that exactly the ring members hold `seq`, in one micro-batch index, in zigzag layout."""
    k = len(seq.ring)
    if k == 1 and len(held) == 1:
        rank, _, shard = held[0]
        if rank != seq.ring[0]:
            raise ValueError(f"sequence {seq.id} is held by ranks [{rank}] but its ring is {seq.ring}")
        if shard.chunks != ((0, seq.length),) and _as_tuples(shard.chunks) != ((0, seq.length),):
            raise ValueError(f"whole sequence {seq.id} (length {seq.length}) is held as {shard.chunks}")
        return
    by_rank = {rank: (index, shard) for rank, index, shard in held}
    if len(by_rank) != len(held):
        raise ValueError(f"sequence {seq.id} is held more than once by one rank: {sorted(r for r, _, _ in held)}")
    if set(by_rank) != set(seq.ring):
        raise ValueError(f"sequence {seq.id} is held by ranks {sorted(by_rank)} but its ring is {seq.ring}")
    if len({index for _, index, _ in held}) != 1:
        raise ValueError(
            f"sequence {seq.id} ring members hold it in different micro-batches "
            f"{ {r: i for r, i, _ in held} }"
        )
    for position, rank in enumerate(seq.ring):
        chunks = by_rank[rank][1].chunks
        expected = zigzag_chunks(seq.length, k, position)
        if chunks != expected and _as_tuples(chunks) != expected:
            raise ValueError(
                f"sequence {seq.id} (length {seq.length}) at ring position {position} (rank {rank}) "
                f"holds {chunks}, expected {expected}"
            )


def _ints(values: list) -> np.ndarray:
    """`values` as an integer array; TypeError when they are not all integers (then `_all_valid` defers)."""
    array = np.array(values) if values else np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"expected integers, got an array of dtype {array.dtype}")
    return array


def _all_valid(plan: "StepPlan") -> bool:
    """Whether `plan` passes `StepPlan._check_each`, decided with array operations over all shards at once.

    Whole sequences (a ring of one rank): held by exactly one shard, on their ring's rank, as the single
    chunk (0, length). Ring sequences: one shard per ring member, all at one micro-batch index, each the
    member's two zigzag chunks. Any doubt — a failed check, a value of an unexpected type — answers
    False and `validate` then runs the per-sequence check, which names the problem: this function may be
    stricter than it, never laxer.
    """
    sequences, num_ranks = plan.sequences, plan.num_ranks
    num_sequences = len(sequences)
    try:
        ids = _ints([s.id for s in sequences])
        lengths = _ints([s.length for s in sequences])
        ratios = np.array([s.offload_ratio for s in sequences] or [0.0])
        rings = [s.ring for s in sequences]
        ring_sizes = _ints([len(ring) for ring in rings])
        members = _ints(list(chain.from_iterable(rings)))
        if ratios.dtype.kind not in "iuf" or not ((ratios >= 0.0) & (ratios <= 1.0)).all():
            return False
        if (ids != np.arange(num_sequences)).any() or (lengths < 1).any() or (ring_sizes < 1).any():
            return False
        if members.size and (members.min() < 0 or members.max() >= num_ranks):  # (keeps the keys below unique)
            return False
        # Every shard with its rank and micro-batch index, flattened rank by rank, micro-batch by micro-batch.
        per_rank = [r.microbatches for r in plan.ranks]
        microbatches = list(chain.from_iterable(per_rank))
        capacities = _ints([mb.capacity for mb in microbatches])
        per_microbatch = [mb.shards for mb in microbatches]
        num_shards = _ints([len(shards) for shards in per_microbatch])
        shards = list(chain.from_iterable(per_microbatch))
        seqs = _ints([shard.seq for shard in shards])
        per_shard = [shard.chunks for shard in shards]
        num_chunks = _ints([len(chunks) for chunks in per_shard])
        pairs = list(chain.from_iterable(per_shard))
        starts, ends = _ints([a for a, _ in pairs]), _ints([b for _, b in pairs])
        if seqs.size and (seqs.min() < 0 or seqs.max() >= num_sequences):
            return False
        # Tokens per micro-batch: chunk widths summed per shard, then per micro-batch.
        widths = np.concatenate(([0], np.cumsum(ends - starts)))
        first_chunk = np.cumsum(num_chunks) - num_chunks
        shard_tokens = np.concatenate(([0], np.cumsum(widths[first_chunk + num_chunks] - widths[first_chunk])))
        first_shard = np.cumsum(num_shards) - num_shards
        if (shard_tokens[first_shard + num_shards] - shard_tokens[first_shard] > capacities).any():
            return False
        # Whole sequences: one holder, on the ring's only rank, holding exactly ((0, length),).
        counts = np.array([len(m) for m in per_rank], dtype=np.int64)
        mb_rank = np.repeat(np.arange(num_ranks), counts)
        shard_rank = np.repeat(mb_rank, num_shards)
        whole = ring_sizes == 1
        on_whole = whole[seqs]
        held = seqs[on_whole]
        at = first_chunk[on_whole]
        if ((np.bincount(seqs, minlength=num_sequences) != 1) & whole).any() or (num_chunks[on_whole] != 1).any():
            return False
        if (shard_rank[on_whole] != members[np.cumsum(ring_sizes) - 1][held]).any():
            return False
        if (starts[at] != 0).any() or (ends[at] != lengths[held]).any():
            return False
        # Ring sequences: each ring member holds one shard, all in one micro-batch index, in zigzag layout.
        if whole.all():
            return True
        ring_seq = seqs[~on_whole]
        k = ring_sizes[ring_seq]
        if int(lengths.max()) * 2 * int(ring_sizes.max()) >= 2**62:  # keep the bound arithmetic exact
            return False
        if (np.bincount(ring_seq, minlength=num_sequences) != np.where(whole, 0, ring_sizes)).any():
            return False
        # The ring position of each shard's rank: (sequence, rank) keys of every ring membership, searched.
        first_member = np.cumsum(ring_sizes) - ring_sizes
        member_at = np.flatnonzero(np.repeat(~whole, ring_sizes))
        keys = np.repeat(np.arange(num_sequences), ring_sizes)[member_at] * num_ranks + members[member_at]
        order = np.argsort(keys, kind="stable")
        shard_keys = ring_seq * num_ranks + shard_rank[~on_whole]
        found = np.searchsorted(keys[order], shard_keys)
        if (found >= keys.size).any() or (keys[order][np.minimum(found, keys.size - 1)] != shard_keys).any():
            return False
        ascending = np.sort(shard_keys)  # not np.unique: NumPy 2 imports numpy.ma on its first call (~25 ms)
        if (ascending[1:] == ascending[:-1]).any():  # a rank holding the sequence twice
            return False
        position = member_at[order][found] - first_member[ring_seq]
        # One micro-batch index per ring sequence.
        mb_index = np.arange(len(microbatches)) - np.repeat(np.cumsum(counts) - counts, counts)
        ring_index = np.repeat(mb_index, num_shards)[~on_whole]
        index_of_seq = np.zeros(num_sequences, dtype=np.int64)
        index_of_seq[ring_seq] = ring_index
        if (index_of_seq[ring_seq] != ring_index).any():
            return False
        # Chunks p and 2k-1-p of 2k (`zigzag_chunk_bounds` is integer arithmetic, so it takes arrays too).
        if (num_chunks[~on_whole] != 2).any():
            return False
        at = first_chunk[~on_whole]
        length = lengths[ring_seq]
        first_start, first_end = zigzag_chunk_bounds(length, k, position)
        second_start, second_end = zigzag_chunk_bounds(length, k, 2 * k - 1 - position)
        if ((starts[at] != first_start) | (ends[at] != first_end)
                | (starts[at + 1] != second_start) | (ends[at + 1] != second_end)).any():
            return False
    except (TypeError, ValueError, IndexError, OverflowError):
        return False
    return True


@dataclass(frozen=True)
class StepPlan:
    """The plan of one global batch over `num_ranks` HDP ranks (see docs/architecture.md, StepPlan JSON)."""

    policy: str
    num_ranks: int
    capacity: int
    sequences: tuple[SequencePlacement, ...]
    ranks: tuple[RankSchedule, ...]
    est_step_time: float = 0.0
    pp_size: int = 1
    vpp_size: int = 1
    """Model chunks (virtual pipeline stages) per pipeline stage: Megatron's interleaved schedule when > 1.
    In the JSON only when > 1, so plans without virtual stages read and write as before."""
    group_size: Optional[int] = None
    """Megatron's microbatch_group_size_per_vp_stage G the plan was made (and timed) for, with virtual
    stages: the runtime runs the step with it (`megatron.core_api.step.step_group_size`). None: the runtime's
    configured G (pp by default), as plans before this field. In the JSON as "microbatch_group_size", only when set."""
    prompt_lengths: Optional[tuple[int, ...]] = None
    """Post-training: the prompt tokens of each sequence's sample (0 <= prompt <= length), whose predictions
    carry no loss (`posttrain.planning.response_masks`). In the JSON only when set."""
    version: int = PLAN_VERSION
    _digest: list = field(default_factory=list, init=False, repr=False, compare=False)

    # --- queries -------------------------------------------------------------------------------
    @property
    def lengths(self) -> list[int]:
        return [seq.length for seq in self.sequences]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def microbatches(self, rank: int) -> tuple[MicroBatch, ...]:
        """The micro-batches HDP rank `rank` runs."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank {rank} is outside this plan's {self.num_ranks} ranks")
        return self.ranks[rank].microbatches

    # --- checking ------------------------------------------------------------------------------
    def validate(self) -> "StepPlan":
        """Check every invariant of the contract; raise ValueError naming the first one broken.

        A 32M-token plan holds ~35K shards, so the checks first run as array operations over all of them
        at once (`_all_valid`); only a plan they cannot prove valid goes through the per-sequence check,
        which names the first broken invariant.
        """
        if self.version != PLAN_VERSION:
            raise ValueError(f"plan version {self.version} is not the supported {PLAN_VERSION}")
        if self.num_ranks <= 0 or self.capacity <= 0 or self.pp_size <= 0 or self.vpp_size <= 0:
            raise ValueError(
                f"num_ranks={self.num_ranks}, capacity={self.capacity}, pp_size={self.pp_size}, "
                f"vpp_size={self.vpp_size} must be > 0"
            )
        if self.vpp_size > 1 and self.pp_size == 1:
            raise ValueError(f"vpp_size={self.vpp_size} needs pipeline parallelism; pp_size is 1")
        if self.group_size is not None and (self.vpp_size == 1 or self.group_size < self.pp_size):
            raise ValueError(f"microbatch group size {self.group_size} needs virtual pipeline stages (vpp_size="
                             f"{self.vpp_size}) and at least pp_size={self.pp_size} (Megatron's interleaved schedule)")
        if [r.rank for r in self.ranks] != list(range(self.num_ranks)):
            raise ValueError(f"ranks must be listed 0..{self.num_ranks - 1} in order")
        if self.prompt_lengths is not None:
            self._check_prompts()
        if not _all_valid(self):
            self._check_each()
        self._check_ring_kinds()
        return self

    def _check_prompts(self) -> None:
        """One prompt length per sequence, each leaving its sample at least one response token."""
        if len(self.prompt_lengths) != len(self.sequences):
            raise ValueError(f"the plan has {len(self.prompt_lengths)} prompt lengths for {len(self.sequences)} "
                             "sequences: give one per sequence")
        for seq, prompt in zip(self.sequences, self.prompt_lengths):
            if isinstance(prompt, bool) or int(prompt) != prompt or not 0 <= prompt <= seq.length:
                raise ValueError(f"sequence {seq.id} has a prompt of {prompt} tokens but {seq.length + 1} tokens in "
                                 "all: pass prompt lengths with 0 <= prompt < tokens (at least one response token)")

    def _check_ring_kinds(self) -> None:
        """Every ring kind is known, "latent" only on rings of more than one rank, and the sequences on one
        ring in one micro-batch (one ring call at run time) share their kind."""
        kinds = {seq.ring_kind for seq in self.sequences}
        if kinds <= {"kv"}:
            return
        for seq in self.sequences:
            if seq.ring_kind not in RING_KINDS:
                raise ValueError(f"sequence {seq.id} ring_kind {seq.ring_kind!r} is not one of {RING_KINDS}")
            if seq.ring_kind != "kv" and len(seq.ring) == 1:
                raise ValueError(f"sequence {seq.id} is whole (ring {seq.ring}) but its ring_kind is {seq.ring_kind!r}")
        calls: dict[tuple[int, tuple[int, ...]], SequencePlacement] = {}
        for schedule in self.ranks:
            for index, mb in enumerate(schedule.microbatches):
                for shard in mb.shards:
                    seq = self.sequences[shard.seq]
                    first = calls.setdefault((index, seq.ring), seq)
                    if len(seq.ring) > 1 and first.ring_kind != seq.ring_kind:
                        raise ValueError(
                            f"sequences {first.id} and {seq.id} share ring {seq.ring} in micro-batch {index} but "
                            f"their ring kinds differ ({first.ring_kind!r}, {seq.ring_kind!r}): one ring call has one "
                            "kind"
                        )

    def _check_each(self) -> None:
        """The invariants checked one sequence and one micro-batch at a time; raises at the first broken one.

        The reference check: `validate` runs it only when the vectorised `_all_valid` could not prove the
        plan valid, so the error names the same first problem either way.
        """
        for index, seq in enumerate(self.sequences):
            if seq.id != index:
                raise ValueError(f"sequence at position {index} has id {seq.id}")
            if seq.length < 1:
                raise ValueError(f"sequence {seq.id} has length {seq.length} < 1")
            if not seq.ring or len(set(seq.ring)) != len(seq.ring):
                raise ValueError(f"sequence {seq.id} ring {seq.ring} is empty or repeats a rank")
            if any(not 0 <= r < self.num_ranks for r in seq.ring):
                raise ValueError(f"sequence {seq.id} ring {seq.ring} names a rank outside 0..{self.num_ranks - 1}")
            if not 0.0 <= seq.offload_ratio <= 1.0:
                raise ValueError(f"sequence {seq.id} offload ratio {seq.offload_ratio} is outside [0, 1]")
        # One pass over every shard: (rank, micro-batch index, shard) of each sequence, and capacities.
        holders: list[list[tuple[int, int, Shard]]] = [[] for _ in self.sequences]
        num_sequences = len(holders)
        for schedule in self.ranks:
            rank = schedule.rank
            for index, mb in enumerate(schedule.microbatches):
                for shard in mb.shards:
                    if not 0 <= shard.seq < num_sequences:
                        raise ValueError(f"rank {rank} holds unknown sequence {shard.seq}")
                    holders[shard.seq].append((rank, index, shard))
                if mb.num_tokens > mb.capacity:
                    raise ValueError(
                        f"rank {rank} micro-batch {index} holds {mb.num_tokens} tokens > its capacity {mb.capacity}"
                    )
        for seq, held in zip(self.sequences, holders):
            _validate_sequence(seq, held)

    # --- statistics ----------------------------------------------------------------------------
    def summary(self, cost_model: Any = None) -> PlanSummary:
        """Balance, ring sizes and (given a CostModel) ring-attention bytes of this plan."""
        ring_sizes: dict[int, int] = {}
        attention_bytes = network_bytes = 0.0
        across = 0
        for seq in self.sequences:
            k = len(seq.ring)
            if k > 1:
                ring_sizes[k] = ring_sizes.get(k, 0) + 1
                if cost_model is not None:
                    member = cost_model.ring_bytes(num_tokens=-(-seq.length // k), ring_size=k, pp_size=self.pp_size,
                                                   kind=seq.ring_kind)
                    attention_bytes += k * member
                    if cost_model.crosses_nodes(seq.ring):
                        across += 1
                        hops = sum(cost_model.crosses_nodes((a, b)) for a, b in zip(seq.ring, seq.ring[1:] + seq.ring[:1]))
                        network_bytes += hops * member
        times = [r.est_time for r in self.ranks]
        mean = sum(times) / len(times)
        counts = [len(r.microbatches) for r in self.ranks]
        return PlanSummary(
            num_sequences=len(self.sequences),
            num_tokens=self.num_tokens,
            num_rings=sum(ring_sizes.values()),
            ring_sizes=dict(sorted(ring_sizes.items())),
            max_microbatches=max(counts),
            min_microbatches=min(counts),
            est_step_time=self.est_step_time,
            balance=max(times) / mean if mean > 0 else 1.0,
            attention_bytes=attention_bytes,
            rings_across_nodes=across,
            network_bytes=network_bytes,
            latent_rings=sum(1 for seq in self.sequences if seq.ring_kind == "latent"),
        )

    # --- serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan in the JSON schema of docs/architecture.md."""
        return {
            "version": self.version,
            "policy": self.policy,
            "num_ranks": self.num_ranks,
            "capacity": self.capacity,
            "pp_size": self.pp_size,
            **({"vpp_size": self.vpp_size} if self.vpp_size > 1 else {}),
            **({"microbatch_group_size": self.group_size} if self.group_size is not None else {}),
            **({"prompt_lengths": list(self.prompt_lengths)} if self.prompt_lengths is not None else {}),
            "sequences": [
                {"id": s.id, "length": s.length, "ring": list(s.ring), "offload_ratio": s.offload_ratio,
                 **({"ring_kind": s.ring_kind} if s.ring_kind != "kv" else {})}
                for s in self.sequences
            ],
            "ranks": [
                {
                    "rank": r.rank,
                    "est_time": r.est_time,
                    "microbatches": [
                        {
                            "est_time": mb.est_time,
                            "capacity": mb.capacity,
                            "shards": [
                                {"seq": sh.seq, "chunks": [list(c) for c in sh.chunks]} for sh in mb.shards
                            ],
                        }
                        for mb in r.microbatches
                    ],
                }
                for r in self.ranks
            ],
            "est_step_time": self.est_step_time,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "StepPlan":
        """Rebuild a plan from `to_dict` output (not validated: call `validate()`). Keys the plan does not
        hold are ignored, e.g. each sequence's `source` that `--hdp-save-plans` adds (read it from the dict)."""
        return cls(
            version=data.get("version", PLAN_VERSION),
            policy=data["policy"],
            num_ranks=data["num_ranks"],
            capacity=data["capacity"],
            pp_size=data.get("pp_size", 1),
            vpp_size=data.get("vpp_size", 1),
            group_size=data.get("microbatch_group_size"),
            prompt_lengths=tuple(data["prompt_lengths"]) if "prompt_lengths" in data else None,
            sequences=tuple(
                SequencePlacement(s["id"], s["length"], tuple(s["ring"]), s.get("offload_ratio", 0.0),
                                  s.get("ring_kind", "kv"))
                for s in data["sequences"]
            ),
            ranks=tuple(
                RankSchedule(
                    rank=r["rank"],
                    est_time=r.get("est_time", 0.0),
                    microbatches=tuple(
                        MicroBatch(
                            capacity=mb["capacity"],
                            est_time=mb.get("est_time", 0.0),
                            shards=tuple(
                                Shard(sh["seq"], tuple(tuple(c) for c in sh["chunks"])) for sh in mb["shards"]
                            ),
                        )
                        for mb in r["microbatches"]
                    ),
                )
                for r in data["ranks"]
            ),
            est_step_time=data.get("est_step_time", 0.0),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "StepPlan":
        return cls.from_dict(json.loads(text))

    def digest(self) -> str:
        """SHA-256 of the canonical JSON: equal on every rank iff the plans are equal."""
        if not self._digest:
            self._digest.append(hashlib.sha256(self.to_json().encode()).hexdigest())
        return self._digest[0]


RING_KINDS = ("kv", "latent")
"""The rings a split document can run: K and V circulate (`attention.zigzag_ring`), or multi-latent
attention's latent and RoPE key do and every member up-projects them (`attention.latent_ring`)."""
