"""Small device tables without host syncs (issue 21 item 7): what the fake-GPU scenarios cannot show on
values. The tables of a micro-batch arrive in one copy with the right values; segment ids and positions
are computed on the device from cu_seqlens; a ring step gathers a set of local rows once, not per step."""

import collections

import torch

from megatron_hdp.attention.backends import Segments, get_backend
from megatron_hdp.attention.backends.base import segment_rows
from megatron_hdp.attention.core_attention import HDPBatchMeta
from megatron_hdp.attention.host_tables import HostTables
from megatron_hdp.attention.ring_plan import Rows, ring_plan
from megatron_hdp.attention.ring_loop import HeldKV, ring_backward, ring_forward
from megatron_hdp.comm.ring_program import run_in_process
from megatron_hdp.data.collate import AttentionGroup

CPU = torch.device("cpu")


def test_tables_arrive_in_one_copy_with_their_values(monkeypatch):
    copies = []
    original = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **kw: copies.append(kw) or original(self, *a, **kw))
    tables, got = HostTables(), {}
    tables.add([0, 3, 7], lambda t: got.update(cu=t), dtype=torch.int32)
    tables.add([], lambda t: got.update(empty=t), dtype=torch.int64)
    tables.add([5, 1], lambda t: got.update(index=t), dtype=torch.int64)
    assert not got, "nothing is delivered before the transfer"
    tables.transfer(CPU)
    assert got["cu"].tolist() == [0, 3, 7] and got["cu"].dtype == torch.int32
    assert got["empty"].numel() == 0 and got["index"].tolist() == [5, 1]
    assert [kw.get("non_blocking") for kw in copies if "non_blocking" in kw] == [True]  # one copy, asynchronous


def test_segment_rows_from_cu_seqlens_match_the_lengths():
    lengths = (1, 4, 2, 7)
    segments = Segments(lengths, lengths, CPU)
    segment, position = segment_rows(segments.cu_seqlens_q, sum(lengths))
    assert segment.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert position.tolist() == [j for n in lengths for j in range(n)]


def test_batch_meta_delivers_every_table_of_its_micro_batch():
    """Local cu_seqlens, and the document lengths in packed order (padding left out)."""
    groups = (
        AttentionGroup(ring=(0,), seq_ids=(0, 1), seqlens=(5, 3), tokens=(0, 8)),
        AttentionGroup(ring=(0,), seq_ids=(), seqlens=(2,), tokens=(8, 10)),
    )
    meta = HDPBatchMeta(groups=groups, hdp_global_ranks=(0,), position_ids=torch.zeros(10, dtype=torch.long))
    assert meta.segments[0].__dict__["cu_seqlens_q"].tolist() == [0, 5, 8]  # delivered, not made on first use
    assert meta.segments[1].__dict__["cu_seqlens_k"].tolist() == [0, 2]
    assert meta.document_lengths.tolist() == [5, 3]


def test_ring_steps_gather_each_set_of_local_rows_once(monkeypatch):
    """Forward: q rows; backward: dout, q, out, lse rows: gathered once per distinct row set, however many
    ring steps use it (each gather of non-contiguous rows is an index_select kernel)."""
    seqlens, size = (5, 9, 14), 3
    plans = [ring_plan(seqlens, size, p, True, CPU) for p in range(size)]
    gen = torch.Generator().manual_seed(0)
    shards = [[torch.randn(plan.num_tokens[p], h, 8, generator=gen) for h in (4, 2, 2)] for p, plan in enumerate(plans)]
    gathers = collections.Counter()
    take = Rows.take
    monkeypatch.setattr(
        Rows, "take", lambda self, x, dim=0: gathers.update([(id(x), self.key, dim)]) or take(self, x, dim)
    )
    backend = get_backend("cpu_flash", device=CPU, dtype=torch.float32)
    results = run_in_process(
        [ring_forward(shards[p][0], HeldKV(*shards[p][1:]), plan=plans[p], backend=backend, scale=0.3)
         for p in range(size)]
    )
    fixed = {id(s[0]) for s in shards}  # q does not change during the forward (out and lse do)
    assert not [key for key, n in gathers.items() if key[0] in fixed and n > 1]
    gathers.clear()
    douts = [torch.randn_like(out) for out, _ in results]
    run_in_process(
        [ring_backward(douts[p], shards[p][0], HeldKV(*shards[p][1:]), *results[p], plan=plans[p], backend=backend,
                       scale=0.3) for p in range(size)]
    )
    fixed |= {id(t) for t in douts} | {id(t) for result in results for t in result}
    repeated = [key for key, n in gathers.items() if key[0] in fixed and n > 1]
    assert not repeated, f"{len(repeated)} row sets gathered on every ring step"


def test_kernel_row_tables_are_computed_from_cu_seqlens_not_copied_from_the_host(monkeypatch):
    """TE's statistics rows and flex's block mask (made in a micro-batch's first layer) come from the
    cu_seqlens that arrived with the micro-batch: no torch.tensor(lengths, device=...) copy, no sync."""
    from megatron_hdp.attention.backends import flex, te_fused

    segments = Segments((3, 5), (3, 5), CPU)
    segments.cu_seqlens_q, segments.cu_seqlens_k  # noqa: B018  (delivered with the micro-batch)

    def no_host_copy(*args, **kwargs):
        raise AssertionError("a table copied from the host inside a layer")

    monkeypatch.setattr(torch, "tensor", no_host_copy)
    te_fused._padded_rows.cache_clear()
    flex._block_mask.cache_clear()
    assert te_fused._padded_rows(segments, 8).tolist() == [0, 1, 2, 8, 9, 10, 11, 12]
    flex._block_mask(segments, True)
    te_fused._padded_rows.cache_clear()
    flex._block_mask.cache_clear()


def test_flex_window_shifts_arrive_with_the_micro_batch(monkeypatch):
    """A windowed ring's pieces at offsets: flex's window mask (made in a micro-batch's first windowed
    layer) reads their shifts from the table the plan scheduled on the micro-batch's one copy, not from a
    torch.tensor(shifts, device=...) copy inside the layer (the fake-GPU scenario `window_ring` found four
    such copies per rank in a micro-batch's first layer)."""
    from megatron_hdp.attention.backends import flex

    plan = ring_plan((64, 30), 4, 0, True, CPU, 12)
    offset = [b for step in plan.blocks for b in step if b.window is not None and any(b.window.shifts)]
    assert offset, "the plan has pieces at offsets"
    tables = HostTables()
    plan.schedule_tables(tables)
    tables.transfer(CPU)

    def no_host_copy(*args, **kwargs):
        raise AssertionError("a table copied from the host inside a layer")

    monkeypatch.setattr(torch, "tensor", no_host_copy)
    flex._block_mask.cache_clear()
    for block in offset:
        flex._block_mask(block.segments, True, block.window)
        assert block.window.shift_table(CPU).tolist() == list(block.window.shifts)
    flex._block_mask.cache_clear()
