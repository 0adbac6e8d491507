"""`PostTrainer`: forward-only log-probs and entropy, and exact train steps, for in-memory rollouts under HDP.

Both calls run the same preparation as pre-training (`data.prepare`: the plan checked on every rank, with
the rollouts checked inside that check; this rank's micro-batches collated by `posttrain.batch`, with the
field "response_mask" when the plan carries prompt lengths; padding micro-batches up to the count the step
runs) and Megatron's own schedule (`megatron.core_api.step.forward_backward`: none, 1F1B or interleaved),
with a forward step that asks the model for its vocabulary-parallel logits and turns them, one micro-batch
at a time, into each token's log-probability of its label and entropy (`megatron.core_api.logprobs`),
after dividing by the sample's temperature.

The train step's gradient is that of sum(w * l) over the global batch, whatever the placement: each
micro-batch returns (K * sum of its w * l, its token count) to Megatron, whose per-token loss
(`calculate_per_token_loss`) divides every gradient by the token count summed over the HDP domain — K,
the plan's token count — so no Megatron, DP, ring or micro-batch factor is left, and the MoE auxiliary
loss keeps its pre-training normalisation (token-weighted over the global batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Hashable, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from megatron_hdp.comm.domain import HDPState
from megatron_hdp.data import quantization
from megatron_hdp.data.prepare import chunk_iterators, check_plan, pad_microbatches, pinned_for
from megatron_hdp.megatron.core_api.forward_step import packed_seq_params
from megatron_hdp.megatron.core_api.logprobs import is_tensor_parallel_first, vocab_parallel_logprobs
from megatron_hdp.megatron.core_api.step import (check_model_config, forward_backward, step_group_size,
                                                 sync_grads_at_schedule_end)
from megatron_hdp.megatron.layers.spec import model_windows
from megatron_hdp.plan.step_plan import StepPlan
from megatron_hdp.posttrain.batch import RolloutMicroBatch, Rollouts, collate_rollouts
from megatron_hdp.posttrain.planning import sample_owner, samples_of_rank
from megatron_hdp.posttrain.seq_reduce import SampleSums


@dataclass
class LocalShard:
    """What `loss_fn` sees of one micro-batch on one rank: per packed token [T] (token-aligned values of the
    token each position predicts; padding tokens have `is_real` False, fields 0 and scalars 1)."""

    logprobs: torch.Tensor
    """log p(predicted token), with the sample's temperature; differentiable."""
    entropy: torch.Tensor
    """Entropy of the predicting distribution; differentiable."""
    fields: dict[str, torch.Tensor]
    scalars: dict[str, torch.Tensor]
    sample: torch.Tensor
    """Plan index of each token's sample (-1 on padding)."""
    target: torch.Tensor
    """Index, in its sample, of the predicted token."""
    is_real: torch.Tensor
    sample_sum: Callable[[torch.Tensor], torch.Tensor]
    """x [T] -> per token, the sum of x over every token of its sample, across its ring (`seq_reduce`)."""

    @property
    def sample_head(self) -> torch.Tensor:
        """[T] float: 1 on the one token of each sample (target 1) that exists on exactly one rank; weight a
        per-sample metric with it to count it once."""
        return (self.target == 1).float()


LossOutput = Union[torch.Tensor, tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]]
"""Per-token losses [T], or (losses, {metric: (numerator [T], denominator [T])})."""
LossFn = Callable[[LocalShard], LossOutput]


@dataclass(frozen=True)
class SampleResult:
    """Token-aligned results of one sample: entry t (t >= 1) is about predicting token t; entry 0 is 0."""

    logprobs: np.ndarray
    entropy: np.ndarray


@dataclass(frozen=True)
class TrainStats:
    """One train step, identical on every rank."""

    objective: float
    """sum(w * l) over the global batch (the function whose gradient the step took)."""
    metrics: dict[str, tuple[float, float]]
    """Each metric's (numerator, denominator), each summed once over the global batch."""
    grad_norm: float
    num_rings: int


class PostTrainer:
    """Runs post-training forwards and train steps of a model (one chunk, or a list of virtual-stage chunks,
    wrapped in Megatron DDP for `train_step`) with its Megatron optimizer (None: forward only)."""

    def __init__(self, *, model: torch.nn.Module | Sequence[torch.nn.Module], state: HDPState,
                 optimizer: Any = None, backend: str = "auto", temperature: str = "temperature") -> None:
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        if len(self.chunks) != state.vpp_size:
            raise ValueError(f"{len(self.chunks)} model chunks for {state.vpp_size} virtual pipeline stages per PP "
                             "rank: pass one chunk per virtual stage")
        self.state, self.optimizer, self.backend, self.temperature = state, optimizer, backend, temperature
        self.config = self.chunks[0].config
        check_model_config(self.config, state=state)
        if self.config.mtp_num_layers:
            raise ValueError(f"mtp_num_layers={self.config.mtp_num_layers}: the post-training door scores the next "
                             "token only; build the policy without multi-token prediction")
        self.pad_to_multiple = quantization.token_multiple(self.config)
        self.device = next(self.chunks[0].parameters()).device
        if optimizer is not None:
            sync_grads_at_schedule_end(self.chunks)

    def _prepare(self, plan: StepPlan, rollouts: Rollouts) -> tuple[list[RolloutMicroBatch], Optional[int]]:
        """This rank's micro-batches of `plan` (checked on every rank with the rollouts), padded and pinned."""
        group = step_group_size(plan, self.config)
        samples: list[int] = []

        def check_inputs(plan: StepPlan) -> None:
            samples.extend(samples_of_rank(plan, self.state.hdp_rank))
            rollouts.check(plan, samples)

        check_plan(plan, state=self.state, group_size=group, check_inputs=check_inputs)
        rollouts = rollouts.with_response_mask(plan, samples)
        batches = collate_rollouts(plan, rollouts, rank=self.state.hdp_rank, pad_to_multiple=self.pad_to_multiple,
                                   samples=samples)
        padded = pad_microbatches(plan, [b.packed for b in batches], state=self.state,
                                  pad_to_multiple=self.pad_to_multiple, group_size=group)
        batches += [RolloutMicroBatch.padding(p, fields=list(rollouts.fields), scalars=list(rollouts.scalars))
                    for p in padded[len(batches):]]
        return pinned_for(batches, self.device), group

    def _run(self, batches: list[RolloutMicroBatch], on_logits: Callable, *, forward_only: bool) -> list[dict]:
        """Megatron's schedule over `batches`; `on_logits(host, batch, logprobs, entropy)` is the loss function
        of each micro-batch on the last stage."""

        def forward_step(data_iterator, model):
            host = next(data_iterator)
            batch = host.to(self.device, non_blocking=True)
            params = packed_seq_params(batch.packed, hdp_global_ranks=self.state.hdp_global_ranks,
                                       backend=self.backend, host=host.packed, windows=model_windows(model))
            output = model(input_ids=batch.packed.tokens[None], position_ids=batch.packed.position_ids[None],
                           attention_mask=None, packed_seq_params=params)
            return output, partial(self._score, on_logits, host, batch)

        return forward_backward(self.chunks, forward_step, chunk_iterators(batches, len(self.chunks)),
                                num_microbatches=len(batches), seq_length=max(b.packed.num_tokens for b in batches),
                                forward_only=forward_only)

    def _score(self, on_logits: Callable, host: RolloutMicroBatch, batch: RolloutMicroBatch, output: torch.Tensor):
        """The loss function of one micro-batch: logits [1, T, V / TP] -> log-probs and entropy -> `on_logits`."""
        logits = output.reshape(-1, output.shape[-1]).float()
        temperature = batch.scalars.get(self.temperature)
        if temperature is not None:
            logits = logits / temperature[:, None]
        logprobs, entropy = vocab_parallel_logprobs(logits, batch.packed.labels)
        return on_logits(host, batch, logprobs, entropy)

    def forward(self, plan: StepPlan, rollouts: Rollouts, *,
                gather: Union[str, Sequence[Hashable]] = "all") -> dict[Hashable, SampleResult]:
        """Log-probs and entropy of every token of the samples `gather` names, on this rank: "all" (every
        sample), "own" (the samples whose ring starts at this HDP rank: each sample on one HDP rank), or a
        list of sample ids (this rank's share in the caller's split). Keys in the caller's sample order."""
        wanted = self._wanted(plan, rollouts, gather)
        pieces: list[tuple[torch.Tensor, ...]] = []

        def collect(host, batch, logprobs, entropy):  # padding is dropped on the host: no device-side nonzero
            pieces.append((host.sample, host.target, logprobs, entropy))
            zero = torch.zeros((), dtype=torch.int, device=logprobs.device)
            return logprobs.new_zeros(()), zero, {}

        batches, _ = self._prepare(plan, rollouts)
        with torch.no_grad():
            self._run(batches, collect, forward_only=True)
        mine = [tuple(t[sample >= 0].numpy() for t in (sample, target, logprobs.cpu(), entropy.cpu()))
                for sample, target, logprobs, entropy in pieces] if is_tensor_parallel_first() else []
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results = {index: SampleResult(np.zeros(plan.sequences[index].length + 1, dtype=np.float32),
                                       np.zeros(plan.sequences[index].length + 1, dtype=np.float32))
                   for index in wanted}
        for sample, target, logprobs, entropy in (piece for rank in everyone for piece in rank):
            for index in set(sample.tolist()) & results.keys():
                at = sample == index
                results[index].logprobs[target[at]] = logprobs[at]
                results[index].entropy[target[at]] = entropy[at]
        return {rollouts.sample_ids[index]: results[index] for index in sorted(results)}

    def _wanted(self, plan: StepPlan, rollouts: Rollouts, gather: Union[str, Sequence[Hashable]]) -> list[int]:
        """Plan indices of the samples `gather` names (ValueError for an unknown mode or sample id)."""
        if gather == "all":
            return list(range(len(plan.sequences)))
        if gather == "own":
            return [i for i, owner in enumerate(sample_owner(plan)) if owner == self.state.hdp_rank]
        if isinstance(gather, str):
            raise ValueError(f"gather={gather!r}: use 'all', 'own' or a list of sample ids")
        index_of = {sid: i for i, sid in enumerate(rollouts.sample_ids)}
        unknown = [sid for sid in gather if sid not in index_of]
        if unknown:
            raise ValueError(f"gather names sample ids {unknown[:5]} that are not in the rollouts")
        return [index_of[sid] for sid in gather]

    def train_step(self, plan: StepPlan, rollouts: Rollouts, *, loss_fn: LossFn, weights: str = "weights") -> TrainStats:
        """One optimizer step on the gradient of sum(w * loss_fn(...)) over the global batch, w the
        token-aligned field `weights` of `rollouts` (`posttrain.weights.loss_weights` makes it from a mode)."""
        if self.optimizer is None:
            raise ValueError("this PostTrainer has no optimizer (forward only): build it with optimizer=...")
        if weights not in rollouts.fields:
            raise ValueError(f"the rollouts have no field {weights!r} of per-token weights: add it (loss_weights)")
        scale = float(plan.num_tokens)
        reports: list[tuple[list[str], torch.Tensor]] = []

        def loss(host, batch, logprobs, entropy):
            shard = LocalShard(logprobs=logprobs, entropy=entropy, fields=batch.fields, scalars=batch.scalars,
                               sample=batch.sample, target=batch.target, is_real=batch.is_real,
                               sample_sum=SampleSums(host.sample, host.packed.groups, self.state.hdp_global_ranks,
                                                     self.device))
            output = loss_fn(shard)
            losses, metrics = output if isinstance(output, tuple) else (output, {})
            objective = torch.where(shard.is_real, batch.fields[weights] * losses, 0.0).sum()
            names = sorted(metrics)
            sums = [objective.detach()] + [part.detach().sum() for name in names for part in metrics[name]]
            reports.append((names, torch.stack(sums).double()))
            return objective * scale, batch.is_real.sum().to(torch.int), {}  # counted on the device: no copy

        batches, _ = self._prepare(plan, rollouts)
        for chunk in self.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._run(batches, loss, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        assert ok, "the fp32 optimizer step cannot be skipped"
        return self._stats(plan, reports, grad_norm)

    def _stats(self, plan: StepPlan, reports: list, grad_norm: Any) -> TrainStats:
        """Sum each rank's reports (last stage, TP rank 0) over every rank: once per token, so once overall."""
        names = reports[0][0] if reports else []
        mine = (names, torch.stack([r[1] for r in reports]).sum(0).cpu().numpy()) if (
            reports and is_tensor_parallel_first()) else None
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        reported = [r for r in everyone if r is not None]
        total = np.sum([r[1] for r in reported], axis=0)
        names = reported[0][0]
        metrics = {name: (float(total[1 + 2 * i]), float(total[2 + 2 * i])) for i, name in enumerate(names)}
        return TrainStats(objective=float(total[0]), metrics=metrics,
                          grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                          num_rings=plan.summary().num_rings)
