"""comm layer of megatron_hdp: rings over global ranks of the HDP communicator, P2P exchange, traffic.

`domain` (`HDPState`: this rank's place in the HDP domain, plain data), `plan_agreement` (the digest
all-gather every step runs before its first ring), `telemetry` (what each rank measures of a step and
gathers over the domain), `collectives` and `launch` (the gloo harness) are imported by their own paths;
importing this package does not start anything.
"""

from megatron_hdp.comm.p2p import Pending, Ring, current_ring, shift
from megatron_hdp.comm.ring_program import WAIT, Post, run_in_process, run_on_ring
from megatron_hdp.comm.traffic import Traffic, count_traffic, reset_traffic, total_traffic

__all__ = [
    "Pending",
    "Post",
    "Ring",
    "Traffic",
    "WAIT",
    "count_traffic",
    "current_ring",
    "reset_traffic",
    "run_in_process",
    "run_on_ring",
    "shift",
    "total_traffic",
]
