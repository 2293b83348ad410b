"""Loads a converted DeepSpeed checkpoint (``dcp-tiered convert deepspeed``) without DeepSpeed.

    torchrun --nproc_per_node=N tests/workers/ds_converted.py --root DST --step TAG
        --native NATIVE_SAVE_DIR --live live.pt --out result.json

At 1 rank into a plain module, at more into FSDP2 (``fully_shard``), through the
``torch.distributed.checkpoint.state_dict`` API. Rank 0 writes where the loaded full params
differ from DeepSpeed's own ``zero_to_fp32`` and the Adam state from the live run's.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed.checkpoint as dcp
from common import finish, init, write_json  # also puts the repo on sys.path
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from dcp_tiered import TieredStorageReader
from tests._model import Tiny, clone, mismatches


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--root", "--step", "--native", "--out"):
        p.add_argument(flag, required=True)
    p.add_argument("--live", help="full params and Adam state at the save (live.pt)")
    a = p.parse_args()
    rank, world = init()
    model = Tiny()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=a.step, storage_reader=TieredStorageReader(a.root))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_model, full_optim = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    full_model, full_optim = clone(full_model), clone(full_optim)
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(rank))
    model(x).float().mean().backward()
    opt.step()  # the loaded state trains
    if rank == 0:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        reference = get_fp32_state_dict_from_zero_checkpoint(a.native)
        live = torch.load(a.live, weights_only=True) if a.live else {}
        adam = {
            name: {k: full_optim["state"][name][k] for k in ("exp_avg", "exp_avg_sq")}
            for name in live
        }
        write_json(
            a.out,
            {
                "params_vs_zero_to_fp32": mismatches(dict(reference), full_model),
                "adam_vs_live": mismatches(
                    {n: {k: v for k, v in s.items() if k != "param"} for n, s in live.items()}, adam
                ),
                "adam_keys": sorted(next(iter(full_optim["state"].values()))),
                "steps": sorted({float(s["step"]) for s in full_optim["state"].values()}),
                "groups": full_optim["param_groups"][0]["params"],
            },
        )
    finish()


if __name__ == "__main__":
    main()
