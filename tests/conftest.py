"""Suite-wide set-up: the gloo children of every test start from a fork server that has imported
megatron-core and the integration once (`comm.launch.preload_in_children`), not each on its own."""

from megatron_hdp.comm.launch import preload_in_children

preload_in_children("megatron.core", "megatron_hdp.megatron.step")
