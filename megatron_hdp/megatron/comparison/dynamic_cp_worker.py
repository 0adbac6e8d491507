"""Child process of policy `megatron-dynamic-cp`: runs the Megatron-LM checkout's DefaultDynamicCPScheduler.

Started by `dynamic_cp_policy` in the checkout (MEGATRON_LM_DIR) with PYTHONPATH = the checkout, so
`megatron` here is the checkout's package, never the installed megatron-core, and
this file imports nothing of megatron_hdp. The scheduler lives in a Megatron newer than the installed one
(`megatron.core.datasets.data_schedule` on the dev branch; it imports parts of megatron.core that 0.19.2
lacks), and one process cannot hold two packages named `megatron`: a child keeps the parent untouched.

Protocol, one JSON object per line: the worker first prints {"ready": true, "megatron_core": <path>} or
{"error": <why>} (then exits); afterwards it answers each request {"lengths": [...], "num_ranks": D,
"capacity": C, "microbatch_group_size_per_vp_stage": int or null, "min_cp_size": int} with
{"groups": sample_id_groups} (Megatron's [micro-batch][DPxCP rank] -> sample ids) or {"error": <why>}.
"""

import json
import os
import sys
import traceback


def _scheduler_class():
    """The checkout's scheduler class, as Megatron's `wrap_data_iterator` looks it up."""
    import megatron.core

    checkout = os.path.realpath(os.environ["MEGATRON_LM_DIR"])
    where = os.path.realpath(megatron.core.__file__)
    if not where.startswith(checkout + os.sep):
        raise ImportError(f"megatron.core came from {where}, not from the checkout {checkout}")
    from megatron.core.datasets.data_schedule import scheduler_map

    return scheduler_map["default_dynamic_cp"], where


def _schedule(scheduler_class, request: dict) -> list:
    """Megatron's own call sequence: the constructor as `wrap_data_iterator` calls it (dp_size x cp_size =
    the DPxCP pool; cp_size 1 is one such factorisation, the scheduler reads only their product), then
    `get_groups_and_subsamples` over (global id, length) pairs as `DpBalancedScheduler.run` step 4."""
    scheduler = scheduler_class(
        request["capacity"],  # max_seqlen_per_dp_cp_rank
        1,  # cp_size
        request["num_ranks"],  # dp_size
        request["microbatch_group_size_per_vp_stage"],
        max_num_seqs=None,
        min_cp_size=request["min_cp_size"],
    )
    return scheduler.get_groups_and_subsamples([(i, int(n)) for i, n in enumerate(request["lengths"])])


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main() -> None:
    try:
        scheduler_class, where = _scheduler_class()
    except Exception as error:  # noqa: BLE001 - any import failure is reported to the parent in one line
        _reply({"error": f"{type(error).__name__}: {error}"})
        return
    _reply({"ready": True, "megatron_core": where})
    for line in sys.stdin:
        try:
            groups = _schedule(scheduler_class, json.loads(line))
            _reply({"groups": [[list(map(int, ids)) for ids in group] for group in groups]})
        except Exception as error:  # noqa: BLE001 - Megatron asserts on inputs it cannot schedule
            last = traceback.extract_tb(error.__traceback__)[-1]
            _reply({"error": f"{type(error).__name__} at {os.path.basename(last.filename)}:{last.lineno}: {error}"})


if __name__ == "__main__":
    main()
