"""Where the ring's fixed cost goes on a GPU: a torch profile of one forward+backward of
`simulated_ring_attention` (k virtual ranks on one GPU, bf16, 16 query / 8 KV heads of 128), after three
warm-ups; prints the ops by host time and by GPU time.

    python benchmarks/ring_profile.py 4096 8      # L tokens, k ranks (README: 77-98 ms host for 8.7 ms GPU)
"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from megatron_hdp.attention import simulated_ring_attention, local_varlen_attention
L, k = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(L, 16, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
kk = torch.randn(L, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
v = torch.randn(L, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
def step():
    out = simulated_ring_attention(q, kk, v, seqlens=[L], ring_size=k)
    out.backward(torch.ones_like(out))
for _ in range(3):
    step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    step(); torch.cuda.synchronize()
ka = prof.key_averages()
print(ka.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))
print(ka.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
