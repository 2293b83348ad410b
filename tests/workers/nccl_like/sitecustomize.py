"""A default group that cannot run CPU collectives (as NCCL cannot), for every process of a test.

A test puts this directory on PYTHONPATH and sets DCP_TIERED_REFUSED_DIR. Python then imports
this module at start-up, in every rank: a torch.distributed collective on the default group
raises when the code that asked for it (the nearest caller that is dcp_tiered or a framework)
is dcp_tiered, as NCCL would for the CPU tensors the checkpoint layer uses, and is recorded in
DCP_TIERED_REFUSED_DIR/<pid>.json (written empty at start-up). The frameworks' own collectives (DeepSpeed, megatron-core,
transformers, accelerate) and the test's training run as before: on a GPU they run on NCCL.
"""

import os

if os.environ.get("DCP_TIERED_REFUSED_DIR"):
    import functools
    import json
    import sys

    import torch.distributed as dist

    COLLECTIVES = (
        "all_reduce",
        "all_gather",
        "all_gather_object",
        "gather_object",
        "broadcast",
        "broadcast_object_list",
        "scatter_object_list",
        "barrier",
        "reduce_scatter",
        "all_to_all",
        "gather",
        "scatter",
        "reduce",
        "monitored_barrier",
    )
    OWNERS = ("dcp_tiered", "deepspeed", "megatron", "transformers", "accelerate")
    refused: list[str] = []

    def _asked_by_us() -> str | None:
        frame = sys._getframe(2)
        while frame is not None:
            module = frame.f_globals.get("__name__", "")
            if module.split(".")[0] in OWNERS:
                return (
                    f"{module}:{frame.f_code.co_name}" if module.startswith("dcp_tiered") else None
                )
            frame = frame.f_back
        return None

    def _guard(name: str) -> None:
        original = getattr(dist, name)

        @functools.wraps(original)
        def guarded(*args, **kwargs):
            group = kwargs.get("group")
            if (group is None or group is dist.group.WORLD) and (who := _asked_by_us()):
                refused.append(f"{name} from {who}")
                _record()
                raise RuntimeError(
                    f"{name} on the default group from {who}: it has no CPU "
                    "backend (an NCCL-only group)"
                )
            return original(*args, **kwargs)

        setattr(dist, name, guarded)

    for _name in COLLECTIVES:
        if hasattr(dist, _name):
            _guard(_name)

    def _record() -> None:
        path = os.path.join(os.environ["DCP_TIERED_REFUSED_DIR"], f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump(refused, f)

    _record()  # an empty record: this process ran with the guard
