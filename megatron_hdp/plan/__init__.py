"""Hybrid Data Parallelism planner: pure Python + numpy, never imports torch or Megatron."""
