"""megatron_hdp: ByteScale's Hybrid Data Parallelism for Megatron-Core.

The layers (see DESIGN.md; tests/test_layers.py checks their order): `plan` and `sim` are pure Python +
numpy; `comm`, `attention`, `offload` and `data` use torch but not Megatron; `megatron` is the
integration with Megatron, `harness` drives it for evidence, `commands` are the CLI. Importing this
package imports none of them.
"""

__version__ = "0.1.0"
