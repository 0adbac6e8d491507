"""megatron_hdp: ByteScale's Hybrid Data Parallelism for Megatron-Core.

The public API is the names below (`__all__`); every other module is internal by convention and may move
between releases (docs/architecture.md is the map of them). Names resolve lazily: importing this package
imports neither torch nor Megatron, so a driver without them can plan (`make_plan`) and ship the plan.

- Megatron-LM: `add_hdp_args`, `install` (what the patched `pretrain_gpt.py` calls; docs/megatron_lm.md).
- Planning (pure Python + numpy): `make_plan` -> `StepPlan`; `HDPConfig`; the cost model of a mesh
  (`mesh_cost_model`, `analytic_cost_model`, `model_shape`, `CostModel`); `register_policy` for a
  policy of your own; `step_time_lower_bound`.
- Simulation: `ClusterSpec`, `compare_policies`, `simulate_step`.
- Megatron-Core API (torch + megatron-core): `initialize_hdp`, the layer spec
  (`get_gpt_layer_with_hdp_spec`, `get_gpt_decoder_block_with_hdp_spec`, `prepare_model_for_hdp`), model
  building (`transformer_config`, `build_gpt[_chunks]`, `wrap[_chunks]_for_training`), `HDPTrainer` (one
  HDP step: plan, collate, Megatron's schedule), `log_token_level_mtp_loss`.
- Data: `HDPSampler`, `HDPDataLoader`, `DocumentSource`, `MapStyleSource`.
- Attention: `ring_attention`, `latent_ring_attention`, `zigzag_token_indices`; offload:
  `ActivationOffloader`.
"""

from megatron_hdp.lazy_exports import lazy_exports

__version__ = "0.1.0"

_PUBLIC = {
    # Megatron-LM
    "add_hdp_args": "megatron_hdp.megatron",
    "install": "megatron_hdp.megatron",
    # planning
    "HDPConfig": "megatron_hdp.config",
    "StepPlan": "megatron_hdp.plan.step_plan",
    "make_plan": "megatron_hdp.plan.planner",
    "register_policy": "megatron_hdp.plan.planner",
    "CostModel": "megatron_hdp.plan.cost.model",
    "mesh_cost_model": "megatron_hdp.plan.cost.mesh",
    "analytic_cost_model": "megatron_hdp.plan.cost.presets",
    "model_shape": "megatron_hdp.plan.cost.presets",
    "step_time_lower_bound": "megatron_hdp.plan.timeline.bounds",
    # simulation
    "ClusterSpec": "megatron_hdp.sim.cluster",
    "compare_policies": "megatron_hdp.sim.compare",
    "simulate_step": "megatron_hdp.sim.simulator",
    # Megatron-Core API
    "initialize_hdp": "megatron_hdp.megatron.core_api.initialize",
    "transformer_config": "megatron_hdp.megatron.core_api.model",
    "build_gpt": "megatron_hdp.megatron.core_api.model",
    "build_gpt_chunks": "megatron_hdp.megatron.core_api.model",
    "wrap_for_training": "megatron_hdp.megatron.core_api.model",
    "wrap_chunks_for_training": "megatron_hdp.megatron.core_api.model",
    "get_gpt_layer_with_hdp_spec": "megatron_hdp.megatron.layers.spec",
    "get_gpt_decoder_block_with_hdp_spec": "megatron_hdp.megatron.layers.spec",
    "prepare_model_for_hdp": "megatron_hdp.megatron.layers.spec",
    "log_token_level_mtp_loss": "megatron_hdp.megatron.layers.mtp",
    "HDPTrainer": "megatron_hdp.megatron.core_api.step",
    # post-training (RL, SFT)
    "plan_rollouts": "megatron_hdp.posttrain.planning",
    "samples_of_rank": "megatron_hdp.posttrain.planning",
    "response_masks": "megatron_hdp.posttrain.planning",
    "loss_weights": "megatron_hdp.posttrain.weights",
    "Rollouts": "megatron_hdp.posttrain.batch",
    "PostTrainer": "megatron_hdp.posttrain.runtime",
    "LocalShard": "megatron_hdp.posttrain.runtime",
    # data
    "HDPSampler": "megatron_hdp.data",
    "HDPDataLoader": "megatron_hdp.data",
    "DocumentSource": "megatron_hdp.data",
    "MapStyleSource": "megatron_hdp.data",
    # attention and offload
    "ring_attention": "megatron_hdp.attention",
    "latent_ring_attention": "megatron_hdp.attention",
    "zigzag_token_indices": "megatron_hdp.attention",
    "ActivationOffloader": "megatron_hdp.offload",
}
"""Public name -> the module it is read from (on first use)."""

__all__, __getattr__ = lazy_exports(__name__, _PUBLIC)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
