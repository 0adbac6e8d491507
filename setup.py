"""megatron_hdp: ByteScale-style Hybrid Data Parallelism for Megatron-Core."""

from setuptools import find_packages, setup

setup(
    name="megatron_hdp",
    version="0.1.0",
    description="Hybrid Data Parallelism (dynamic DP x CP) for long-context training with Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_hdp", "megatron_hdp.*"]),
    package_data={"megatron_hdp": ["py.typed"]},
    # torch and megatron-core are installed by the Makefile on Python 3.11 (CPU wheel, --no-deps
    # megatron-core); a plain `pip install .` on Python >= 3.12 resolves them normally. The versions are
    # README.md's "Supported versions" table (tests/commands/test_versions.py holds the two together).
    # psutil: megatron-core's torch_dist checkpoint writer (filesystem_async.py) needs it and does not declare it
    install_requires=["torch>=2.6", "megatron-core>=0.19,<0.21", "numpy", "scipy", "tqdm", "psutil"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "tensorboard", "ninja"],  # ninja: the fake-GPU harness builds its CUDA guard
        "te": ["transformer-engine[pytorch]>=2.0,<3"],  # te_fused attention backend: TE 2.x API
        "flash-attn": ["flash-attn>=2.6,<3"],  # flash_attn attention backend: FlashAttention-2 varlen API
        "plot": ["matplotlib"],
        "megatron-lm": ["pybind11"],  # builds a Megatron-LM checkout's dataset helpers (docs/megatron_lm.md)
    },
    entry_points={"console_scripts": ["megatron-hdp=megatron_hdp.cli:main"]},
)
