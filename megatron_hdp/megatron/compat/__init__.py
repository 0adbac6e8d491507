"""Which Megatron releases HDP runs on (`versions`), and the CPU shims that let Megatron run without CUDA
(`cpu_shims`, applied only when CUDA is absent). The bottom of the Megatron layer: imports none of it."""
