"""attention layer of megatron_hdp: ring attention for packed documents (THD) and the local kernels.

* `ring_attention` — a document split over a ring of any global ranks (per-document zigzag, causal,
  GQA), by point-to-point messages in the HDP communicator.
* `latent_ring_attention` — multi-latent attention's ring: the latent circulates, every member
  up-projects it (`simulated_latent_ring_attention`: k virtual ranks in one process).
* `local_varlen_attention` — documents held whole by this rank: one local kernel call.
* `zigzag_token_indices` — which packed rows a ring position holds.
* `simulated_ring_attention` — the ring algorithm for k virtual ranks in one process.
* `backends` — the local kernels behind one interface; `available_backends`, `get_backend`.
Bytes moved are counted by `megatron_hdp.comm.traffic` (`count_traffic`, re-exported here).
"""

from megatron_hdp.attention.backends import available_backends, get_backend
from megatron_hdp.attention.latent_ring import latent_ring_attention, simulated_latent_ring_attention
from megatron_hdp.attention.layout import zigzag_token_indices
from megatron_hdp.attention.local import local_varlen_attention
from megatron_hdp.attention.zigzag_ring import ring_attention, simulated_ring_attention
from megatron_hdp.comm.traffic import count_traffic

__all__ = [
    "available_backends",
    "count_traffic",
    "get_backend",
    "latent_ring_attention",
    "local_varlen_attention",
    "ring_attention",
    "simulated_latent_ring_attention",
    "simulated_ring_attention",
    "zigzag_token_indices",
]
