"""The MoE router's auxiliary losses under HDP: per document, so that they do not depend on the packing.

Megatron's load-balancing loss (`moe_router_load_balancing_type="aux_loss"`, the Switch loss) is
computed over the tokens of one micro-batch: with T tokens, E experts, top-k routing, P_e the sum of the
router probabilities of expert e and f_e the number of tokens routed to it,

    aux(mb) = coeff * E / (k * T^2) * sum_e P_e * f_e,

and with `calculate_per_token_loss` Megatron backpropagates T * aux(mb) / (loss tokens of the global
batch). The product P_e * f_e couples all tokens of the micro-batch, so the loss changes with which
documents HDP packs together, with how a ring splits a document, and with padding micro-batches (a
padding token is routed like any other).

Under HDP the loss is therefore defined per document: each document d of the global batch (length L_d)
adds L_d * aux(d) / (loss tokens of the global batch), aux(d) being Megatron's formula over the tokens
of d alone. That is exactly what Megatron computes for plain data parallelism with one document per
micro-batch (the exactness tests' reference), whatever the plan: which documents share a micro-batch,
which rank runs them, or over how many ranks a ring splits a document. A ring member holds only its
zigzag shard of d, so the router counts f_e of its shard and exchanges them with the other ring members
(E numbers per document per MoE layer, point-to-point, in the layer where the ring's attention already
binds them); its probabilities P_e are its own shard's, and the members' contributions add up to d's.
Tokens outside every document (padding, padding micro-batches) add neither aux loss nor z-loss: a
padding micro-batch gives the router no gradient.

The z-loss (`moe_z_loss_coeff`) is a sum over tokens already; it only needs the padding masked out.

Sequence parallelism: each TP rank's router sees its slice of the packed rows; the document counts f_e
are summed over the TP group, each TP rank adds the aux loss of its rows' probabilities, and Megatron
sums the router weight's gradient over TP (it is marked `sequence_parallel`).

`DocumentAuxLossRouter` is Megatron's `TopKRouter` with both losses computed that way; the HDP layer
spec uses it, and `remember_documents` (a forward pre-hook on the model) tells it each micro-batch's
documents from the `HDPBatchMeta` that travels in `packed_seq_params`.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter

from megatron_hdp.attention.core_attention import HDPBatchMeta
from megatron_hdp.plan.zigzag import zigzag_num_tokens

PACKING_DEPENDENT_TYPES = ("seq_aux_loss", "global_aux_loss")
"""Megatron's other load-balancing losses: over a whole packed micro-batch, or averaged over the
micro-batches run so far; both change with the plan, so HDP rejects them."""


@dataclass(frozen=True)
class DocumentRows:
    """One document of a packed micro-batch, as this rank holds it."""

    seq: int
    """Sequence id in the step's plan."""
    rows: tuple[int, int]
    """[start, end) of this rank's tokens of the document in the packed micro-batch."""
    length: int
    """The document's full length (all ring members together)."""
    peers: tuple[int, ...]
    """Global ranks of the other members of the document's ring (empty: the document is whole here)."""


def document_rows(meta: HDPBatchMeta, *, hdp_rank: int) -> list[DocumentRows]:
    """The documents of the packed micro-batch `meta` describes, with HDP rank `hdp_rank`'s rows of each;
    padding groups are left out."""
    documents = []
    for group in meta.groups:
        if not group.seq_ids:
            continue
        position = group.ring.index(hdp_rank)
        peers = tuple(meta.hdp_global_ranks[r] for r in group.ring if r != hdp_rank)
        offset = group.tokens[0]
        for seq, length in zip(group.seq_ids, group.seqlens):
            local = zigzag_num_tokens(length, len(group.ring), position)
            documents.append(DocumentRows(seq=seq, rows=(offset, offset + local), length=length, peers=peers))
            offset += local
        assert offset == group.tokens[1], f"group rows {group.tokens} do not hold its documents' shards"
    return documents


_current_documents: Optional[list[DocumentRows]] = None
_current_lengths: Optional[torch.Tensor] = None
"""The documents' lengths on the device (`HDPBatchMeta.document_lengths`, in `_current_documents`' order)."""


def remember_documents(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook (with kwargs) of an HDP model: keep the documents of the micro-batch it is about
    to run for the model's `DocumentAuxLossRouter`s (None without HDP metadata: a forward that needs no
    aux loss, such as evaluation, runs without it)."""
    global _current_documents, _current_lengths
    meta = getattr(kwargs.get("packed_seq_params"), "hdp", None)
    _current_documents = (
        None if meta is None else document_rows(meta, hdp_rank=meta.hdp_global_ranks.index(dist.get_rank()))
    )
    _current_lengths = None if meta is None else meta.document_lengths


def install_document_hook(model: torch.nn.Module) -> None:
    """Register `remember_documents` on `model` (a GPTModel built with the HDP spec) if it has MoE
    routers of this module."""
    if any(isinstance(m, DocumentAuxLossRouter) for m in model.modules()):
        model.register_forward_pre_hook(remember_documents, with_kwargs=True)


def _documents() -> list[DocumentRows]:
    if _current_documents is None:
        raise RuntimeError(
            "the HDP MoE aux loss / z-loss needs the micro-batch's documents: run the model with "
            "HDPPackedSeqParams (megatron_hdp.megatron.core_api.forward_step) after prepare_model_for_hdp"
        )
    return _current_documents


def document_expert_counts(documents: list[DocumentRows], local_counts: torch.Tensor) -> torch.Tensor:
    """[D, E] tokens routed to each expert over each whole document, from this rank's `local_counts` of
    its shards: the shard counts of ring-split documents are exchanged point-to-point with the other
    members (posted in sequence-id order on every rank, so that two rings sharing a pair of ranks match)."""
    totals = local_counts.clone()
    ops, received = [], []
    for index in sorted(range(len(documents)), key=lambda i: documents[i].seq):
        for peer in documents[index].peers:
            buffer = torch.empty_like(local_counts[index])
            ops.append(dist.P2POp(dist.isend, local_counts[index].contiguous(), peer))
            ops.append(dist.P2POp(dist.irecv, buffer, peer))
            received.append((index, buffer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for index, buffer in received:
        totals[index] += buffer
    return totals


class DocumentAuxLossRouter(TopKRouter):
    """Megatron's TopKRouter with the load-balancing loss and the z-loss per document (module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        used = self.routing_type if isinstance(self.routing_type, list) else [self.routing_type]
        rejected = [t for t in PACKING_DEPENDENT_TYPES if t in used and self.get_aux_loss_coeff(t) > 0]
        if rejected:
            raise ValueError(
                f"moe_router_load_balancing_type {rejected[0]!r} depends on how HDP packs micro-batches; "
                "use 'aux_loss' (computed per document under HDP)"
            )
        if self.is_aux_loss_enabled() or config.moe_z_loss_coeff:
            if not config.calculate_per_token_loss:
                raise ValueError("the HDP MoE aux loss needs calculate_per_token_loss=True")
            if config.recompute_granularity == "full" or (
                config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or [])
            ):
                # a recomputed router runs in the backward, when the documents remembered are another
                # micro-batch's (1F1B)
                raise ValueError(
                    f"the HDP MoE aux loss and z-loss do not support recomputing the router "
                    f"(recompute_granularity={config.recompute_granularity!r}, "
                    f"recompute_modules={config.recompute_modules})"
                )

    def _local_rows(self, documents: list[DocumentRows], num_rows: int) -> list[tuple[int, int]]:
        """Each document's rows among the `num_rows` the router sees, relative to them: with sequence
        parallelism this TP rank holds rows [tp_rank * num_rows, (tp_rank + 1) * num_rows) of the packed
        micro-batch, otherwise all of them."""
        offset = self.tp_group.rank() * num_rows if self.config.sequence_parallel else 0
        clipped = []
        for doc in documents:
            start = min(max(doc.rows[0] - offset, 0), num_rows)
            clipped.append((start, max(min(doc.rows[1] - offset, num_rows), start)))
        return clipped

    def _padding_rows(self, num_rows: int, device: torch.device) -> torch.Tensor:
        """[num_rows] bool on `device`, True for the rows the router sees that lie outside every document.
        Filled on the device (no copy from the host: this runs in every MoE layer of every micro-batch)."""
        padding = torch.ones(num_rows, dtype=torch.bool, device=device)
        for start, end in self._local_rows(_documents(), num_rows):
            padding.narrow(0, start, end - start).fill_(False)
        return padding

    def apply_z_loss(self, logits: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Megatron's z-loss with the rows outside every document masked out."""
        if padding_mask is None and self.config.moe_z_loss_coeff and self.training and torch.is_grad_enabled():
            padding_mask = self._padding_rows(logits.shape[0], logits.device)
        return super().apply_z_loss(logits, padding_mask=padding_mask)

    def _apply_aux_loss(
        self,
        probs: torch.Tensor,
        scores_for_aux_loss: torch.Tensor,
        routing_map: torch.Tensor,
        with_padding_mask: bool = False,
    ) -> torch.Tensor:
        """Attach sum over this rank's documents of (its share of) L_d * aux(d) to `probs`."""
        coeff = self.get_aux_loss_coeff("aux_loss")
        documents = _documents()
        if coeff == 0 or not documents:
            return probs
        rows = self._local_rows(documents, routing_map.shape[0])
        local_counts = torch.stack([routing_map[a:b].sum(0) for a, b in rows]).float()
        if self.config.sequence_parallel:
            # this HDP rank's counts of each document: its TP ranks each hold a slice of the rows
            dist.all_reduce(local_counts, group=self.tp_group)
        counts = document_expert_counts(documents, local_counts)
        prob_sums = torch.stack([scores_for_aux_loss[a:b].sum(0) for a, b in rows])
        assert _current_lengths is not None and _current_lengths.shape == (len(documents),)
        lengths = _current_lengths.to(prob_sums.dtype)  # on the device already: no copy per MoE layer
        num_experts = self.config.num_moe_experts
        weighted = ((prob_sums * counts.to(prob_sums.device)).sum(1) / lengths).sum() * (
            num_experts * coeff / self.topk
        )
        mtp_layers = self.config.mtp_num_layers or 0
        if self.is_mtp_layer and self.config.mtp_use_repeated_layer:
            weighted = weighted / mtp_layers  # one MTP layer run at every depth: Megatron's 1 / depths
        num_local_tokens = sum(b - a for a, b in rows)
        get_moe_metrics_tracker().record(  # Megatron's slots: MTP layers after the decoder's
            "load_balancing_loss",
            weighted.detach() / (coeff * max(num_local_tokens, 1)),
            self.layer_number + (self.config.num_layers if self.is_mtp_layer else 0),
            self.config.num_layers + mtp_layers,
            reduce_group=self.tp_cp_group,
        )
        # with calculate_per_token_loss, finalize_model_grads divides every gradient by the global batch's
        # loss tokens: `weighted` is already the token-weighted sum of the documents' aux losses (with
        # sequence parallelism, of this TP rank's rows: the router weight's gradient is summed over TP)
        return MoEAuxLossAutoScaler.apply(probs, weighted)


def with_document_aux_loss_router(spec: Any) -> Any:
    """`spec` (a GPT layer spec, changed in place) with `DocumentAuxLossRouter` as its MoE router, if it
    has an MoE layer (Megatron builds that one as a partial of MoELayer with `submodules`)."""
    mlp = spec.submodules.mlp
    submodules = getattr(mlp, "keywords", {}).get("submodules") if isinstance(mlp, functools.partial) else None
    if submodules is None:
        submodules = getattr(mlp, "submodules", None)
    if submodules is None or not hasattr(submodules, "router"):
        return spec
    routed = dataclasses.replace(submodules, router=DocumentAuxLossRouter)
    if isinstance(mlp, functools.partial):
        spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": routed})
    else:
        mlp.submodules = routed
    return spec
