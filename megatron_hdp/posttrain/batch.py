"""In-memory ragged post-training inputs keyed by sample id, collated into THD micro-batches of a StepPlan.

`Rollouts` holds each sample's tokens, any token-aligned side fields the caller names (loss mask,
advantages, old / reference log-probs, per-token weights, ...) and per-sample scalars (temperature).
`collate_rollouts` packs one rank's micro-batches of a plan whose sequence i is `sample_ids[i]`
(`posttrain.planning`): the packing is the project's one THD collation (`data.collate.collate_microbatch`),
run over *token indices* instead of tokens: read_tokens returns the flat index of each raw token, so the
collated inputs and labels are indices, and gathering tokens and side fields at the label index splits,
zigzag-shards and next-token-shifts every field exactly as the labels are (the token-aligned convention of
`posttrain.planning`: the value at token t goes with the prediction of token t). Scalars are spread over
their sample's tokens. A rank needs only the samples of its own shards (`planning.samples_of_rank`).
A plan with prompt lengths adds the field `RESPONSE_MASK` (`Rollouts.with_response_mask`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Mapping, Optional, Sequence

import numpy as np
import torch

from megatron_hdp.data.collate import PackedMicroBatch, collate_microbatch
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.posttrain.planning import response_masks

RESPONSE_MASK = "response_mask"
"""The field a plan with prompt lengths adds: 1 on the prediction of each response token (`planning.response_masks`)."""


@dataclass(frozen=True)
class Rollouts:
    """A post-training batch in memory. Sample i of the plan is `sample_ids[i]` (the caller's order)."""

    sample_ids: tuple[Hashable, ...]
    """Every sample of the global batch, in the order the plan was made for."""
    tokens: Mapping[Hashable, np.ndarray]
    """Sample id -> its int token ids [N] (prompt then response). A rank may hold only its own samples."""
    fields: Mapping[str, Mapping[Hashable, np.ndarray]] = field(default_factory=dict)
    """Field name -> sample id -> float values [N], token-aligned (entry t goes with predicting token t)."""
    scalars: Mapping[str, Mapping[Hashable, float]] = field(default_factory=dict)
    """Scalar name -> sample id -> value (e.g. "temperature")."""

    def check(self, plan: StepPlan, samples: Sequence[int]) -> None:
        """ValueError unless the plan is for these samples and the named `samples` (plan indices) carry
        tokens and every field and scalar, each field as long as its tokens."""
        if len(plan.sequences) != len(self.sample_ids):
            raise ValueError(f"the plan holds {len(plan.sequences)} samples but the rollouts name "
                             f"{len(self.sample_ids)}: plan the same batch")
        if plan.prompt_lengths is not None and RESPONSE_MASK in self.fields:
            raise ValueError(f"the rollouts give a field {RESPONSE_MASK!r} but the plan's prompt lengths make it: "
                             "rename your field or plan without prompt_lengths")
        for index in samples:
            sid = self.sample_ids[index]
            if sid not in self.tokens:
                raise ValueError(f"sample {sid!r} is in this rank's part of the plan but its tokens were not "
                                 "given: ship every sample planning.samples_of_rank names")
            count = len(self.tokens[sid])
            if count != plan.sequences[index].length + 1:
                raise ValueError(f"sample {sid!r} has {count} tokens but the plan was made for "
                                 f"{plan.sequences[index].length + 1}: plan with these rollouts' token counts")
            for name, values in self.fields.items():
                if sid not in values or len(values[sid]) != count:
                    got = len(values[sid]) if sid in values else "no"
                    raise ValueError(f"field {name!r} of sample {sid!r} has {got} values for {count} tokens: "
                                     "give one value per token (token-aligned)")
            for name, values in self.scalars.items():
                if sid not in values:
                    raise ValueError(f"scalar {name!r} of sample {sid!r} is missing: give it for every sample")

    def with_response_mask(self, plan: StepPlan, samples: Sequence[int]) -> "Rollouts":
        """These rollouts with the field `RESPONSE_MASK` of the named `samples` (plan indices) when `plan`
        carries prompt lengths; unchanged otherwise."""
        if plan.prompt_lengths is None:
            return self
        masks = dict(zip((self.sample_ids[i] for i in samples), response_masks(plan, samples)))
        return dataclasses.replace(self, fields={**self.fields, RESPONSE_MASK: masks})


@dataclass
class RolloutMicroBatch:
    """One rank's micro-batch of rollouts: the packed model inputs and, per packed token, what it is."""

    packed: PackedMicroBatch
    """Model inputs (real token ids, labels, positions, rings) in the THD layout of `data.collate`."""
    sample: torch.Tensor
    """[T] int64: the plan index of each token's sample, -1 on padding."""
    target: torch.Tensor
    """[T] int64: the index t, in its sample, of the token each position predicts (0 on padding)."""
    fields: dict[str, torch.Tensor]
    """Name -> [T] float32 side field at the predicted token (0 on padding)."""
    scalars: dict[str, torch.Tensor]
    """Name -> [T] float32 scalar of the token's sample (1 on padding)."""

    @property
    def is_real(self) -> torch.Tensor:
        """[T] bool: a token of a sample (False on padding)."""
        return self.sample >= 0

    @classmethod
    def padding(cls, packed: PackedMicroBatch, *, fields: Sequence[str], scalars: Sequence[str]) -> "RolloutMicroBatch":
        """A padding micro-batch (`data.prepare.pad_microbatches`) with empty fields and unit scalars."""
        size = packed.num_tokens
        return cls(packed=packed, sample=torch.full((size,), -1, dtype=torch.int64),
                   target=torch.zeros(size, dtype=torch.int64),
                   fields={name: torch.zeros(size) for name in fields},
                   scalars={name: torch.ones(size) for name in scalars})

    def to(self, device: torch.device, *, non_blocking: bool = False) -> "RolloutMicroBatch":
        """The same micro-batch with every tensor on `device`."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return RolloutMicroBatch(packed=self.packed.to(device, non_blocking=non_blocking), sample=move(self.sample),
                                 target=move(self.target), fields={k: move(v) for k, v in self.fields.items()},
                                 scalars={k: move(v) for k, v in self.scalars.items()})

    def pin_memory(self) -> "RolloutMicroBatch":
        """The same micro-batch in page-locked host memory."""
        return dataclasses.replace(self, packed=self.packed.pin_memory(), sample=self.sample.pin_memory(),
                                   target=self.target.pin_memory(),
                                   fields={k: v.pin_memory() for k, v in self.fields.items()},
                                   scalars={k: v.pin_memory() for k, v in self.scalars.items()})


class _FlatSamples:
    """The samples one rank holds, concatenated: flat index -> (sample, token index, token, fields)."""

    def __init__(self, rollouts: Rollouts, samples: Sequence[int]):
        self.offset: dict[int, int] = {}
        sample, target, tokens = [np.full(1, -1)], [np.zeros(1, dtype=np.int64)], [np.zeros(1, dtype=np.int64)]
        values: dict[str, list[np.ndarray]] = {name: [np.zeros(1)] for name in rollouts.fields}
        scalars: dict[str, list[np.ndarray]] = {name: [np.ones(1)] for name in rollouts.scalars}
        offset = 1  # flat index 0 is what padding reads: no sample
        for index in samples:
            sid = rollouts.sample_ids[index]
            count = len(rollouts.tokens[sid])
            self.offset[index] = offset
            offset += count
            sample.append(np.full(count, index))
            target.append(np.arange(count))
            tokens.append(np.asarray(rollouts.tokens[sid], dtype=np.int64))
            for name, per_sample in rollouts.fields.items():
                values[name].append(np.asarray(per_sample[sid], dtype=np.float32))
            for name, per_sample in rollouts.scalars.items():
                scalars[name].append(np.full(count, per_sample[sid], dtype=np.float32))
        self.sample = torch.from_numpy(np.concatenate(sample).astype(np.int64))
        self.target = torch.from_numpy(np.concatenate(target).astype(np.int64))
        self.tokens = torch.from_numpy(np.concatenate(tokens))
        self.fields = {name: torch.from_numpy(np.concatenate(v).astype(np.float32)) for name, v in values.items()}
        self.scalars = {name: torch.from_numpy(np.concatenate(v).astype(np.float32)) for name, v in scalars.items()}

    def read_indices(self, seq: int, start: int, end: int) -> np.ndarray:
        """The `data.collate.TokenReader` of flat indices: raw tokens [start, end) of sample `seq`."""
        return np.arange(self.offset[seq] + start, self.offset[seq] + end, dtype=np.int64)


def collate_rollouts(
    plan: StepPlan, rollouts: Rollouts, *, rank: int, pad_to_multiple: int = 1, samples: Optional[Sequence[int]] = None
) -> list[RolloutMicroBatch]:
    """HDP rank `rank`'s micro-batches of `plan` over `rollouts` (module docstring), each a multiple of
    `pad_to_multiple` tokens. `samples`: the plan indices this rank holds (default: read off the plan)."""
    if samples is None:
        samples = sorted({shard.seq for mb in plan.microbatches(rank) for shard in mb.shards})
    flat = _FlatSamples(rollouts, samples)
    batches = []
    for microbatch in plan.microbatches(rank):
        index = collate_microbatch(plan, microbatch, flat.read_indices, pad_to_multiple=pad_to_multiple, rank=rank)
        label = index.labels
        packed = dataclasses.replace(index, tokens=flat.tokens[index.tokens], labels=flat.tokens[label])
        batches.append(RolloutMicroBatch(
            packed=packed, sample=flat.sample[label], target=flat.target[label],
            fields={name: values[label] for name, values in flat.fields.items()},
            scalars={name: values[label] for name, values in flat.scalars.items()},
        ))
    return batches
