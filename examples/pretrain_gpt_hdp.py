"""GPT pretraining on `megatron.training.pretrain` with megatron_hdp's flags: no Megatron-LM checkout needed.

    torchrun --nproc-per-node 8 examples/pretrain_gpt_hdp.py <Megatron flags> --hdp --calculate-per-token-loss ...

It is Megatron-LM's `pretrain_gpt.py` reduced to what the installed megatron-core (0.19.x or 0.20.x, which ship
`megatron/training`) provides: GPT datasets (indexed `--data-path`, `--mock-data`, `--sft`) and a plain
token-level forward step. With `--hdp`, `megatron_hdp.megatron.install()` replaces the data loader,
the forward step and the per-rank micro-batch counts; without it this trains as plain Megatron, which
is what the HDP run is compared with. `main(argv)` runs the same in-process (tests, CPU examples).
"""

import sys
from functools import partial
from typing import Optional

import megatron_hdp.megatron as hdp
from megatron_hdp.megatron.compat.versions import require_megatron_training, use_prebuilt_dataset_helpers

require_megatron_training()
use_prebuilt_dataset_helpers()  # the megatron-core wheel has no Makefile for them, but ships them built

import torch  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split  # noqa: E402

from megatron_hdp.megatron.compat.cpu_shims import apply_cpu_shims, apply_training_cpu_shims  # noqa: E402
from megatron_hdp.megatron.datasets.mock_mix import mock_gpt_dataset_type  # noqa: E402


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-level loss: (sum of token losses, token count, report) as Megatron's per-token loss expects."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    """Plain (non-HDP) forward step over Megatron's fixed-length GPT samples."""
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    output = model(
        tokens, batch["position_ids"], batch.get("attention_mask"), labels=labels, loss_mask=batch["loss_mask"]
    )
    return output, partial(loss_func, batch["loss_mask"])


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """GPT train/valid/test datasets from --data-path (indexed), --mock-data or --sft, on every rank.

    Every rank builds them (not only TP rank 0): the HDP loader plans from document lengths on every
    rank and reads only its own shards' tokens. With --hdp it plans their documents (one sequence each,
    cut at --seq-length), not Megatron's --seq-length windows; `--mock-data --hdp-mock-mix NAME` draws
    the mock documents' lengths from a named mix.
    """
    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        context_parallel_size=args.context_parallel_size,  # SFTDataset reads it
    )
    if args.sft:
        from megatron.training.datasets.sft_dataset import SFTDataset

        dataset_type = SFTDataset
    elif args.mock_data and args.hdp_mock_mix is not None:
        dataset_type = mock_gpt_dataset_type(args.hdp_mock_mix)
    else:
        dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(dataset_type, train_val_test_num_samples, lambda: True, config).build()


def main(argv: Optional[list[str]] = None) -> None:
    """Parse Megatron's flags plus --hdp*, install HDP when asked, and run `megatron.training.pretrain`."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if apply_cpu_shims():  # no CUDA: run megatron.training on the CPU (gloo), with or without --hdp
        apply_training_cpu_shims()  # before parsing: validate_args asks the GPU's architecture with TP > 1
        if not torch.distributed.is_initialized():  # torchrun: env:// rendezvous, gloo instead of NCCL
            torch.distributed.init_process_group("gloo")
    args = parse_and_validate_args(extra_args_provider=hdp.add_hdp_args, args_defaults={"tokenizer_type": "NullTokenizer"})
    hdp.install(args)  # with --hdp: HDP data loader, forward step, micro-batch counts, logging; else nothing
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    setattr(datasets_provider, "is_distributed", True)
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
