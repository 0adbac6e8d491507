"""benchmarks/offload_bench.py's byte count of one step's saved activations: right, and leaving nothing alive."""

import gc
import weakref

import torch

from megatron_hdp.offload.reference_model import ReferenceGPT
from megatron_hdp.plan.cost.presets import ModelShape

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=128, vocab_size=97)


def test_saved_bytes_counts_what_a_backward_keeps_and_frees_it(benchmark_script):
    """Reference: a forward kept for its backward, its saved storages read from the graph's own hooks
    while the loss is alive. The bench's count must equal it, and once it returns no activation may stay
    alive (its pack hook once returned the tensors, a cycle through autograd that kept 22.4 GiB on an
    H100 through every later trial)."""
    saved_bytes = benchmark_script("offload_bench").saved_bytes

    torch.manual_seed(0)
    model = ReferenceGPT(SHAPE)
    tokens = torch.randint(0, SHAPE.vocab_size, (1, 96))
    batch = (tokens, tokens.roll(-1, dims=1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    seen: dict[int, int] = {}

    def record(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(record, lambda t: t):
        loss = model(*batch)
    loss.backward()  # the reference's graph goes the way training's does
    expected = sum(seen.values())

    outputs = []  # every layer's output is saved for the next layer's backward
    hooks = [layer.register_forward_hook(lambda module, args, output: outputs.append(weakref.ref(output)))
             for layer in model.layers]
    assert saved_bytes(model, batch) == expected
    for hook in hooks:
        hook.remove()
    gc.collect()
    assert len(outputs) == SHAPE.num_layers and all(output() is None for output in outputs)
