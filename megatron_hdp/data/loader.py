"""HDPDataLoader: per step, the StepPlan of the global batch and this rank's collated micro-batches.

It replaces what Megatron's `build_pretraining_data_loader` returns (and works as a
`--dataloader-type external` iterator): iterating it yields one `HDPStep` per training step. Each step:

1. `HDPSampler` picks the global batch's documents and their plan lengths (index only, no tokens).
2. `make_plan` turns the lengths into a StepPlan with the policy of `HDPConfig.hdp_policy` — the same
   plan on every rank, since every rank plans the same lengths with the same code.
3. This rank collates only its own micro-batches, reading only the token ranges of its shards (a chunk
   [a, b) reads raw tokens [a, b + 1) of its document): a document split over 200 ranks is read once,
   in 200 pieces, not 200 times.

Steps 1-3 for step n+1 run ahead while step n trains (started by the first `next`): in a background
thread, up to `prefetch` steps ahead, or — with `workers` >= 1, e.g. Megatron's --num-workers — in
DataLoader worker processes, which keeps the pure-Python planner from taking the GIL from the training
loop (worker w plans steps w, w + workers, ...; they arrive in order); `prefetch=0` without workers plans
in the consumer's thread. On the consumer side, before a step is handed out, the plan digests are
all-gathered over the HDP domain when torch.distributed is initialized (`comm.plan_agreement`; off
with check_plans=False when the consumer checks itself, as both training drivers do in
`data.prepare.prepare_step`): a rank with a
different dataset, seed or config fails loudly here instead of hanging in a ring later. `consumed_samples`
advances by the documents of each handed-out step and is what to checkpoint; a loader built with it
resumes with the same documents and plans.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import numpy as np

from megatron_hdp.comm.plan_agreement import check_plan_agreement
from megatron_hdp.config import HDPConfig
from megatron_hdp.data.collate import PackedMicroBatch, collate_microbatch
from megatron_hdp.data.prefetch import close_stream, prefetched
from megatron_hdp.data.sampler import GlobalBatch, HDPSampler
from megatron_hdp.data.source import DocumentSource, limit_lengths
from megatron_hdp.plan.cost.model import CostModel
from megatron_hdp.plan.planner import make_plan
from megatron_hdp.plan.cost.sharding import min_ring_size
from megatron_hdp.plan.step_plan import StepPlan

logger = logging.getLogger(__name__)


@dataclass
class HDPStep:
    """Everything one rank needs for one training step."""

    plan: StepPlan
    """The global batch's plan (identical on every rank of the HDP domain)."""
    microbatches: list[PackedMicroBatch]
    """This rank's micro-batches, in execution order (may be empty: the rank then runs an empty one)."""
    sample_ids: np.ndarray
    """Dataset sample id of each plan sequence (plan sequence i is sample sample_ids[i])."""
    epoch: int
    consumed_samples: int
    """Documents consumed after this step: the value Megatron checkpoints as consumed_train_samples."""
    plan_seconds: float
    """Time spent planning this step (in the background thread)."""
    load_seconds: float
    """Time spent reading and collating this rank's tokens (in the background thread)."""
    reader: "StepReader"
    """This step's reads (kept in memory): what `read_tokens` and `read_loss_mask` serve."""

    def __getstate__(self) -> dict:
        """Pickled with the plan as its JSON: from_json is ~15x faster than unpickling the plan's objects
        (what a step from a worker process costs the consumer)."""
        return {**self.__dict__, "plan": self.plan.to_json()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, plan=StepPlan.from_json(state["plan"]))

    @property
    def read_tokens(self) -> Callable[[int, int, int], np.ndarray]:
        """read_tokens(seq, start, end): raw tokens of plan sequence `seq`, for code that collates itself
        (`HDPTrainer.step(plan, read_tokens, read_loss_mask=...)`): this rank's ranges come from memory."""
        return self.reader.tokens

    @property
    def read_loss_mask(self) -> Optional[Callable[[int, int, int], np.ndarray]]:
        """The dataset's loss mask of input positions [start, end) of a sequence; None when every position
        counts (then the global batch's loss-token count is `plan.num_tokens`; with a mask, Megatron's
        per-token loss sums the micro-batches' counts over the HDP domain)."""
        return self.reader.loss_mask if self.reader.has_loss_mask else None


def pool_length_limit(longest: int, *, num_ranks: int, config: HDPConfig, cost_model: CostModel) -> Optional[int]:
    """The longest document `num_ranks` ranks can hold, or None when even `longest` fits.

    Uses the planner's own ring-size rule (`plan.cost.sharding.min_ring_size`: capacity, zigzag rounding and
    the offload ratio the cost model lets hide), searched by bisection — the rule needs more ranks for
    longer documents. Policies with a stricter rule (static's power-of-two CP) may still refuse a batch;
    their error then names the samples.
    """
    def fits(length: int) -> bool:
        try:
            min_ring_size(length, capacity=config.hdp_capacity, num_ranks=num_ranks, cost_model=cost_model,
                          max_offload_ratio=config.max_offload_ratio)
        except ValueError:
            return False
        return True

    if fits(longest):
        return None
    low, high = config.hdp_capacity, longest  # fits(low) holds (one rank), fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


class StepReader:
    """One step's reads by plan sequence id: `tokens(seq, start, end)` (raw tokens) and, when the source
    has a loss mask, `loss_mask(seq, start, end)` (input positions). Each range is remembered, so a second
    collation of the same shards (by a trainer that collates itself) costs no I/O."""

    def __init__(self, source: DocumentSource, sample_ids: np.ndarray):
        self.source = source
        self.sample_ids = sample_ids
        self.has_loss_mask = hasattr(source, "read_loss_mask")
        self._tokens: dict[tuple[int, int, int], np.ndarray] = {}
        self._masks: dict[tuple[int, int, int], np.ndarray] = {}

    def __getstate__(self) -> dict:
        """Sent from a worker process without the source (the consumer re-attaches its own)."""
        return {**self.__dict__, "source": None}

    def tokens(self, seq: int, start: int, end: int) -> np.ndarray:
        key = (seq, start, end)
        if key not in self._tokens:
            self._tokens[key] = self.source.read(int(self.sample_ids[seq]), start, end)
        return self._tokens[key]

    def loss_mask(self, seq: int, start: int, end: int) -> np.ndarray:
        key = (seq, start, end)
        if key not in self._masks:
            self._masks[key] = self.source.read_loss_mask(int(self.sample_ids[seq]), start, end)
        return self._masks[key]


class HDPDataLoader:
    """Iterate over the training steps of one HDP rank (see the module docstring)."""

    def __init__(
        self,
        source: DocumentSource,
        *,
        rank: int,
        num_ranks: int,
        config: HDPConfig,
        cost_model: CostModel | Callable[[], CostModel],
        seed: int,
        consumed_samples: int = 0,
        global_batch_size: Optional[int] = None,
        max_length: Optional[int] = None,
        shuffle: bool = True,
        max_epochs: Optional[int] = None,
        pp_size: int = 1,
        vpp_size: int = 1,
        pad_to_multiple: int = 1,
        mtp_depth: int = 0,
        prefetch: int = 1,
        workers: int = 0,
        group: Any = None,
        check_plans: bool = True,
    ):
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank {rank} is outside the HDP domain of {num_ranks} ranks")
        self._cost_model = cost_model
        lengths = np.asarray(source.lengths, dtype=np.int64)
        limit, why = self.sample_length_limit(lengths, max_length, num_ranks=num_ranks, config=config,
                                              cost_model=self.cost_model)
        self.length_limit = limit
        """The longest sample this loader trains (None: no limit); longer ones were refused or truncated."""
        lengths = limit_lengths(lengths, max_length=limit, overlong=config.hdp_overlong_documents, why=why)
        tokens = config.hdp_global_batch_tokens
        if tokens is not None and global_batch_size is not None:
            logger.info("hdp_global_batch_tokens=%d sets the global batch; global_batch_size %d is ignored",
                        tokens, global_batch_size)
        self.sampler = HDPSampler(
            lengths,
            seed=seed,
            global_batch_size=None if tokens is not None else global_batch_size,
            global_batch_tokens=tokens,
            consumed_samples=consumed_samples,
            shuffle=shuffle,
            max_epochs=max_epochs,
        )
        self.source = source
        self.rank = rank
        self.num_ranks = num_ranks
        self.config = config
        self.pp_size = pp_size
        self.vpp_size = vpp_size
        """Virtual pipeline stages per PP rank the plans are made for (Megatron's interleaved schedule)."""
        self.pad_to_multiple = pad_to_multiple
        self.mtp_depth = mtp_depth
        """Multi-token prediction depth D of the model: each chunk also reads the D tokens after it."""
        self.group = group
        self.check_plans = check_plans
        self.consumed_samples = int(consumed_samples)
        if prefetch < 0 or workers < 0:
            raise ValueError(f"prefetch and workers must be >= 0, got {prefetch} and {workers}")
        self.prefetch = prefetch
        self.workers = workers
        self.wait_seconds = 0.0
        """Total time the consumer waited for a step (what the background work failed to hide)."""
        self._stream: Optional[Iterator[HDPStep]] = None
        self._closed = False

    @property
    def cost_model(self) -> CostModel:
        """The cost model the next step is planned with: the one given, or, when a function was given (e.g.
        `megatron.pretrain.runtime.HDPRuntime.current_cost_model`, which the online refit updates), what
        it returns now. Worker processes plan with the model current when they start."""
        return self._cost_model() if callable(self._cost_model) else self._cost_model

    @staticmethod
    def sample_length_limit(
        lengths: np.ndarray, max_length: Optional[int], *, num_ranks: int, config: HDPConfig, cost_model: CostModel
    ) -> tuple[Optional[int], str]:
        """The longest sample this run can train, and why: the model's `max_length`, and the longest
        document the HDP pool can hold (`pool_length_limit`) when the dataset has longer ones."""
        limits = []
        if max_length is not None:
            limits.append((max_length, f"the model's max_length {max_length}"))
        pool = pool_length_limit(int(lengths.max()), num_ranks=num_ranks, config=config, cost_model=cost_model)
        if pool is not None:
            offload = f"offload ratio <= {config.max_offload_ratio:g}" if config.max_offload_ratio else "no offloading"
            limits.append((pool, f"the most {num_ranks} ranks x hdp_capacity {config.hdp_capacity} hold with {offload}"))
        return min(limits) if limits else (None, "")

    # --- background work -----------------------------------------------------------------------
    def plan(self, batch: GlobalBatch) -> StepPlan:
        """The StepPlan of one global batch; a planner error names the dataset samples involved."""
        lengths = batch.lengths.tolist()
        try:
            plan = make_plan(
                lengths, num_ranks=self.num_ranks, config=self.config, cost_model=self.cost_model, pp_size=self.pp_size,
                vpp_size=self.vpp_size,
            )
        except ValueError as error:
            longest = int(np.argmax(batch.lengths))
            raise ValueError(
                f"cannot plan the global batch at consumed_samples={batch.consumed_samples} "
                f"(samples {batch.sample_ids[:8].tolist()}{'...' if batch.num_samples > 8 else ''}, longest "
                f"sample {int(batch.sample_ids[longest])} with {int(batch.lengths[longest])} tokens): {error}"
            ) from error
        if plan.lengths != lengths:
            raise ValueError(f"the {plan.policy} plan's sequence lengths disagree with the sampled batch's")
        return plan

    def reader(self, sample_ids: np.ndarray) -> StepReader:
        """The reads of a global batch of these dataset samples (plan sequence i is sample_ids[i])."""
        return StepReader(self.source, sample_ids)

    def load(self, plan: StepPlan, reader: StepReader, *, rank: Optional[int] = None) -> list[PackedMicroBatch]:
        """Collate the micro-batches of `rank` (default: this loader's) of `plan`; only the token ranges of
        its shards are read."""
        rank = self.rank if rank is None else rank
        mask = reader.loss_mask if reader.has_loss_mask else None
        return [
            collate_microbatch(plan, mb, reader.tokens, pad_to_multiple=self.pad_to_multiple, read_loss_mask=mask,
                               rank=rank, mtp_depth=self.mtp_depth)
            for mb in plan.microbatches(rank)
        ]

    def _steps(self, shard: int = 0, num_shards: int = 1) -> Iterator[HDPStep]:
        """Steps shard, shard + num_shards, ... (all of them by default), planned and loaded."""
        for index, batch in enumerate(self.sampler):
            if index % num_shards != shard:
                continue
            start = time.perf_counter()
            plan = self.plan(batch)
            planned = time.perf_counter()
            reader = self.reader(batch.sample_ids)
            microbatches = self.load(plan, reader)
            yield HDPStep(
                plan=plan,
                microbatches=microbatches,
                sample_ids=batch.sample_ids,
                epoch=batch.epoch,
                consumed_samples=batch.next_consumed_samples,
                plan_seconds=planned - start,
                load_seconds=time.perf_counter() - planned,
                reader=reader,
            )

    def __getstate__(self) -> dict:
        """What a worker process needs (it runs `_steps`): no stream, no process group."""
        state = dict(self.__dict__)
        state.update(_stream=None, group=None, _cost_model=self.cost_model)
        return state

    # --- consumer side -------------------------------------------------------------------------
    def __iter__(self) -> "HDPDataLoader":
        return self

    def __next__(self) -> HDPStep:
        if self._stream is None:
            if self._closed:
                raise StopIteration
            # Started on first use, so a loader that is built but never iterated costs no thread or process.
            self._stream = prefetched(self._steps, depth=self.prefetch, workers=self.workers,
                                      name=f"hdp-loader-{self.rank}")
        start = time.perf_counter()
        step = next(self._stream)
        self.wait_seconds += time.perf_counter() - start
        step.reader.source = self.source  # a step from a worker process arrives without it
        if self.check_plans:
            check_plan_agreement(step.plan, group=self.group)
        self.consumed_samples = step.consumed_samples
        return step

    def state_dict(self) -> dict:
        """The resume state: documents consumed by the steps handed out so far."""
        return {"consumed_samples": self.consumed_samples}

    def close(self) -> None:
        """Stop the background thread or worker processes (idempotent); nothing is yielded afterwards."""
        self._closed = True
        if self._stream is not None:
            close_stream(self._stream)
            self._stream = None

    def __enter__(self) -> "HDPDataLoader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
