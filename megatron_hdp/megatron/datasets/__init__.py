"""Megatron's datasets as HDP document sources: GPT and blended indexed datasets (`sources`, which also
builds the HDP data loader for Megatron-LM), Megatron's SFT conversations (`sft_source`) and the mock GPT
dataset with a document-length mix (`mock_mix`)."""
