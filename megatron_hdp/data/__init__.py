"""data layer of megatron_hdp: the drop-in HDP sampler and loader for Megatron datasets (no Megatron
import here; the Megatron dataset adapters live in `megatron_hdp.megatron.datasets.sources`) and THD collation;
`blend` splits a blend's tokens by its weights (pure numpy).

Public API: `HDPSampler` (global batches of documents, deterministic and resumable), `HDPDataLoader` /
`HDPStep` (plan + this rank's collated micro-batches per step, prefetched in the background),
`DocumentSource` (what a dataset must expose), `DocumentPieces` (documents cut at a maximum length) and `MapStyleSource` (datasets with a `lengths` array).
Resolved lazily, so that importing one numpy-only submodule of this package does not import torch.
"""

from megatron_hdp.lazy_exports import lazy_exports

_EXPORTS = {
    "HDPDataLoader": "megatron_hdp.data.loader",
    "HDPStep": "megatron_hdp.data.loader",
    "pool_length_limit": "megatron_hdp.data.loader",
    "GlobalBatch": "megatron_hdp.data.sampler",
    "HDPSampler": "megatron_hdp.data.sampler",
    "DocumentPieces": "megatron_hdp.data.source",
    "DocumentSource": "megatron_hdp.data.source",
    "MapStyleSource": "megatron_hdp.data.source",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
