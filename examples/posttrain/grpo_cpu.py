"""GRPO-style post-training of a tiny Megatron GPT on N gloo CPU ranks through `megatron_hdp.posttrain`.

Each step: rollouts (sampled from the current policy on rank 0, or with `--rollouts synthetic` a seeded
bimodal length mix: mostly short responses, a few long ones that the planner puts on rings), a reward
per sample and group-normalised advantages, the plan (`plan_rollouts` of the token counts and the prompt
lengths, capacity `--capacity`), old log-probs by the forward-only path of the policy and reference
log-probs of a frozen copy, then one train step of a clipped policy-gradient loss plus a k3 KL term over
the response tokens: the plan's response mask (`response_masks`) makes the token-mean weights
(`loss_weights`), and `loss_fn` reads the same mask from the field "response_mask" that `PostTrainer`
adds. Per step it prints the rings, the objective, the mean reward and the KL.

`--reference` repeats every step in one process without HDP (Megatron's stock layer spec, each sample
alone, a float64 log-softmax, its own response mask and token-mean weights, the same optimizer) on the
same rollouts, and prints per step the largest absolute difference of the old log-probs and of the
parameters after the step; the run fails (exit 1) when one exceeds 1e-5 or a step has no sample on a
ring.

    python examples/posttrain/grpo_cpu.py --ranks 4 --reference
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import numpy as np

VOCAB = 128
TOLERANCE = 1e-5
LR, ADAM_EPS = 1e-4, 1e-4
CLIP, KL_COEFF = 0.2, 0.05


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=4, help="gloo CPU ranks (the HDP domain)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--max-length", type=int, default=96, help="longest sample (prompt + response) in tokens")
    parser.add_argument("--capacity", type=int, default=48, help="tokens a rank holds per micro-batch (HDP's C)")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=4, help="responses per prompt (GRPO group)")
    parser.add_argument("--rollouts", choices=("sampled", "synthetic"), default="sampled")
    parser.add_argument("--reference", action="store_true", help="repeat every step without HDP and compare")
    args = parser.parse_args(argv)
    for name in ("ranks", "steps", "capacity", "prompts", "group_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_length < 16:
        parser.error(f"--max-length must be >= 16 (prompts take up to 8 tokens), got {args.max_length}")
    if not args.capacity + 2 <= args.max_length <= args.ranks * args.capacity + 1:
        parser.error(f"--max-length {args.max_length} must exceed --capacity {args.capacity} + 1 (a sample on a ring) "
                     f"and fit the {args.ranks} ranks' {args.ranks * args.capacity} tokens")
    return args


def response_lengths(rng: np.random.Generator, args: argparse.Namespace, prompt: int) -> list[int]:
    """The bimodal mix: responses of 4-16 tokens, and with probability 0.15 a long one of 60-100% of the
    room left; every sample fits `--max-length`."""
    room = args.max_length - prompt
    lengths = []
    for i in range(args.group_size):
        long = rng.random() < 0.15
        lengths.append(int(rng.integers(int(0.6 * room), room + 1)) if long else int(rng.integers(4, min(16, room) + 1)))
    return lengths


def make_rollouts(step: int, args: argparse.Namespace, sampler=None) -> dict:
    """One step's samples (plain numpy, picklable): tokens, prompt token count and prompt (group) index;
    prompts of 4-8 random tokens, responses of the bimodal mix's lengths, sampled by `sampler(prompt,
    length)` or random."""
    rng = np.random.default_rng([args.seed, step])
    samples = {}
    for p in range(args.prompts):
        prompt = rng.integers(0, VOCAB, int(rng.integers(4, 9)))
        lengths = response_lengths(rng, args, len(prompt))
        if p == 0:  # one long response per step at least: a sample the plan splits over a ring
            lengths[0] = max(lengths[0], args.capacity + 2 - len(prompt))
        for g, length in enumerate(lengths):
            response = sampler(prompt, length) if sampler else rng.integers(0, VOCAB, length)
            tokens = np.concatenate([prompt, response]).astype(np.int64)
            samples[f"p{p}g{g}"] = {"tokens": tokens, "prompt_tokens": len(prompt), "group": p}
    return samples


def rewards_and_advantages(samples: dict) -> tuple[dict, dict]:
    """A toy reward (the share of even token ids in the response) and GRPO's group-normalised advantage."""
    reward = {sid: float((s["tokens"][s["prompt_tokens"]:] % 2 == 0).mean()) for sid, s in samples.items()}
    advantage = {}
    for p in {s["group"] for s in samples.values()}:
        group = [sid for sid, s in samples.items() if s["group"] == p]
        values = np.array([reward[sid] for sid in group])
        for sid, value in zip(group, values):
            advantage[sid] = float((value - values.mean()) / (values.std() + 1e-6))
    return reward, advantage


def grpo_token_losses(logprobs, old, ref, advantage, mask):
    """Clipped policy-gradient loss plus k3 KL against the reference, per token (torch tensors)."""
    import torch

    ratio = torch.exp(logprobs - old)
    pg = -torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    return (pg + KL_COEFF * kl) * mask, kl * mask


def _models(*, hdp: bool, init=None):
    """The policy (in Megatron DDP with its optimizer) and a frozen reference copy, from `init` or seeded."""
    from megatron_hdp.harness.exactness import full_weights, load_full_weights
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.megatron.core_api.model import build_gpt, wrap_for_training

    policy = build_gpt(tiny_llama_config(), vocab_size=VOCAB, max_sequence_length=256, hdp=hdp)
    frozen = build_gpt(tiny_llama_config(), vocab_size=VOCAB, max_sequence_length=256, hdp=hdp)
    init = init or full_weights(policy)
    for model in (policy, frozen):
        load_full_weights(model, init)
    ddp, optimizer = wrap_for_training(policy, lr=LR, adam_eps=ADAM_EPS, clip_grad=0.0)
    return ddp, optimizer, frozen, init


def _sampler(model, rng):
    """sample(prompt, length): `length` tokens drawn from `model` (a stock-spec GPT) after `prompt`."""
    import torch

    def sample(prompt, length):
        tokens = torch.as_tensor(prompt)
        with torch.no_grad():
            for _ in range(length):
                logits = model(input_ids=tokens[None], position_ids=torch.arange(len(tokens))[None], attention_mask=None)
                probs = torch.softmax(logits[0, -1].double(), -1).numpy()
                tokens = torch.cat([tokens, torch.tensor([rng.choice(VOCAB, p=probs / probs.sum())])])
        return tokens[len(prompt):].numpy()

    return sample


def hdp_worker(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """The HDP run: every step's rollouts, old log-probs, statistics and the parameters after it."""
    import torch.distributed as dist

    from megatron_hdp.config import HDPConfig
    from megatron_hdp.harness.exactness import full_weights, load_full_weights
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.megatron.core_api.model import build_gpt
    from megatron_hdp.harness.model import tiny_llama_config
    from megatron_hdp.plan.cost.presets import analytic_cost_model
    from megatron_hdp.posttrain.batch import Rollouts
    from megatron_hdp.posttrain.planning import plan_rollouts, response_masks
    from megatron_hdp.posttrain.runtime import PostTrainer
    from megatron_hdp.posttrain.weights import loss_weights

    state = initialize_hdp(seed=args.seed)
    ddp, optimizer, frozen, init = _models(hdp=True)
    policy = PostTrainer(model=ddp, optimizer=optimizer, state=state)
    reference = PostTrainer(model=frozen, state=state)
    sampler_model = build_gpt(tiny_llama_config(), vocab_size=VOCAB, max_sequence_length=256, hdp=False) \
        if args.rollouts == "sampled" and rank == 0 else None
    config = HDPConfig(hdp_capacity=args.capacity, hdp_offload=False)
    cost_model = analytic_cost_model("llama-7b")  # shapes the placement only; the results are placement-free
    steps = []
    for step in range(args.steps):
        box = [None]
        if rank == 0:
            sampler = None
            if sampler_model is not None:
                load_full_weights(sampler_model, full_weights(ddp))
                sampler = _sampler(sampler_model, np.random.default_rng([args.seed, step, 1]))
            box = [make_rollouts(step, args, sampler)]
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        ids = tuple(samples)
        tokens = {s: samples[s]["tokens"] for s in ids}
        plan = plan_rollouts([len(tokens[s]) for s in ids], prompt_lengths=[samples[s]["prompt_tokens"] for s in ids],
                             num_ranks=state.hdp_size, config=config, cost_model=cost_model)
        rollouts = Rollouts(sample_ids=ids, tokens=tokens)
        old = policy.forward(plan, rollouts)
        ref = reference.forward(plan, rollouts)
        _, advantage = rewards_and_advantages(samples)
        fields = {"advantage": {s: np.full(len(tokens[s]), advantage[s], dtype=np.float32) for s in ids},
                  "old": {s: r.logprobs for s, r in old.items()}, "ref": {s: r.logprobs for s, r in ref.items()},
                  "weights": dict(zip(ids, loss_weights(response_masks(plan), mode="token-mean")))}
        stats = policy.train_step(plan, Rollouts(sample_ids=ids, tokens=tokens, fields=fields), loss_fn=_loss_fn)
        steps.append({"samples": samples, "old": {s: r.logprobs for s, r in old.items()},
                      "objective": stats.objective, "kl": stats.metrics["kl"], "rings": stats.num_rings,
                      "params": full_weights(ddp) if rank == 0 else None})
    return {"init": init, "steps": steps}


def _loss_fn(shard):
    """The GRPO loss on one rank's shard, masked by the plan's response mask, and the KL as a metric
    (numerator, denominator)."""
    f = shard.fields
    mask = f["response_mask"]
    losses, kl = grpo_token_losses(shard.logprobs, f["old"], f["ref"], f["advantage"], mask)
    return losses, {"kl": (kl, mask)}


def _plain_logprobs(model, tokens):
    """log p(token t | tokens < t) for t >= 1 (entry 0 is 0), float64, of a stock-spec model on one sample."""
    import torch

    tokens = torch.as_tensor(tokens)
    logits = model(input_ids=tokens[None], position_ids=torch.arange(len(tokens))[None], attention_mask=None)
    logp = torch.log_softmax(logits[0, :-1].double(), -1).gather(-1, tokens[1:, None]).squeeze(-1)
    return torch.cat([logp.new_zeros(1), logp])


def reference_worker(rank: int, world_size: int, init: dict, steps: list) -> list[dict]:
    """The same steps in one process without HDP: stock spec, each sample alone, Megatron's optimizer."""
    import torch

    from megatron_hdp.harness.exactness import full_weights
    from megatron_hdp.megatron.core_api.initialize import initialize_hdp
    from megatron_hdp.megatron.core_api.step import forward_backward, sync_grads_at_schedule_end

    initialize_hdp(seed=0)
    ddp, optimizer, frozen, _ = _models(hdp=False, init=init)
    sync_grads_at_schedule_end([ddp])
    out = []
    for step in steps:
        samples = step["samples"]
        with torch.no_grad():
            old = {s: _plain_logprobs(ddp, samples[s]["tokens"]).float().numpy() for s in samples}
            ref = {s: _plain_logprobs(frozen, samples[s]["tokens"]).float().numpy() for s in samples}
        _, advantage = rewards_and_advantages(samples)
        # the response mask and token-mean weights of its own: 1 / (response tokens of the whole batch)
        masks = {s: torch.arange(1, len(x["tokens"])) >= x["prompt_tokens"] for s, x in samples.items()}
        num_response_tokens = sum(int(mask.sum()) for mask in masks.values())

        def forward_step(data_iterator, model):
            sid = next(data_iterator)
            logprobs = _plain_logprobs(model, samples[sid]["tokens"])[1:]

            def loss(_):
                mask = masks[sid].double()
                losses, _ = grpo_token_losses(logprobs, torch.as_tensor(old[sid][1:]).double(),
                                              torch.as_tensor(ref[sid][1:]).double(), advantage[sid], mask)
                return losses.sum() / num_response_tokens, torch.zeros((), dtype=torch.int), {}

            return logprobs, loss

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        forward_backward([ddp], forward_step, iter(samples), num_microbatches=len(samples),
                         seq_length=max(len(s["tokens"]) for s in samples.values()))
        optimizer.step()
        out.append({"old": old, "params": full_weights(ddp)})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_hdp.comm.launch import run_gloo

    run = run_gloo(hdp_worker, args.ranks, args, timeout_s=1800)[0]
    reference = run_gloo(reference_worker, 1, run["init"], run["steps"], timeout_s=1800)[0] if args.reference else None
    ok = True
    print(f"{'step':>4} {'samples':>7} {'rings':>5} {'objective':>11} {'reward':>7} {'kl':>10}"
          + (f" {'max|dlogp|':>11} {'max|dparam|':>11}" if reference else ""))
    for i, step in enumerate(run["steps"]):
        reward, _ = rewards_and_advantages(step["samples"])
        line = (f"{i:>4} {len(step['samples']):>7} {step['rings']:>5} {step['objective']:>11.6f} "
                f"{np.mean(list(reward.values())):>7.3f} {step['kl'][0] / step['kl'][1]:>10.3e}")
        ok &= step["rings"] > 0
        if reference:
            mine = reference[i]
            dlogp = max(float(np.abs(step["old"][s] - mine["old"][s]).max()) for s in step["samples"])
            dparam = max(float(np.abs(step["params"][n] - mine["params"][n]).max()) for n in mine["params"])
            line += f" {dlogp:>11.2e} {dparam:>11.2e}"
            ok &= dlogp <= TOLERANCE and dparam <= TOLERANCE
        print(line)
    if not ok:
        print(f"FAILED: a step had no sample on a ring or a difference above {TOLERANCE}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
