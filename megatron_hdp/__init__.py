"""megatron_hdp: ByteScale's Hybrid Data Parallelism for Megatron-Core.

The layers (see DESIGN.md): `plan` and `sim` are pure Python + numpy; `comm`, `attention`, `offload`
and `data` use torch but not Megatron; only `megatron` imports Megatron. Importing this package imports
none of them.
"""

__version__ = "0.1.0"
