"""Suite-wide set-up, shared by every folder of tests/.

- The gloo children of every test start from a fork server that has imported megatron-core,
  `megatron.training` and the integration once (`comm.launch.preload_in_children`), not each on its own
  (~5 s of CPU per child of a pretrain run otherwise).
- `demo_data_prefix`: one small Megatron indexed dataset (the demo's: 256 documents, vocabulary 256,
  up to 256 tokens), built once per session for every test that trains on "some real documents".
- The helpers the folders share (`plan_reference.py`, `attention_reference.py`, `fake_gpu.py`,
  `pretrain_harness.py`, ...) sit beside this file, which pytest puts on `sys.path`.
"""

import pytest

from megatron_hdp.comm.launch import preload_in_children

preload_in_children("megatron.core", "megatron_hdp.megatron.core_api.step", "megatron_hdp.megatron.pretrain.install",
                    "megatron_hdp.megatron.pretrain.runtime", "megatron.training.training")


@pytest.fixture(scope="session")
def demo_data_prefix(tmp_path_factory) -> str:
    """The path prefix of the demo's indexed dataset, built once per session."""
    from megatron_hdp.harness.build_dataset import build_demo_dataset

    return build_demo_dataset(tmp_path_factory.mktemp("demo_data"), num_docs=256, vocab_size=256, max_length=256)
