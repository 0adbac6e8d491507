"""The model side of the integration: Megatron's GPT layer spec with HDP's core attention (`spec`), the
packed-sequence parameters every HDP layer reads (`packed_seq`), multi-latent attention on latent rings
(`mla`), multi-token prediction (`mtp`), the document-level MoE aux loss (`moe_aux_loss`), and the
TransformerConfig options HDP refuses (`options`)."""
