"""harness layer of megatron_hdp: what drives the integration for evidence, not for users' training.

`calibrate` measures a reference layer's compute and the offload link and fits the cost model
(`megatron-hdp calibrate`). Each module is imported by its own path; importing this package imports
none of them (some import Megatron, some only torch).
"""
