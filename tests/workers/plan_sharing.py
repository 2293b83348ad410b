"""Three saves with the manager's planner (DCP's plan caching on) to two roots: one of a state
every rank holds alike, one with tensors of each rank's own. Each rank then reports how many
distinct objects DCP's plan caches and ours hold for the items, what ``dcp.save`` returned
(``returned``: DCP broadcasts the coordinator's metadata to the other ranks), and that every
step loads back; rank 0 writes the reports to --out."""

from __future__ import annotations

import argparse

import common
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import SavePlanner

from dcp_tiered import TieredLoadPlanner, TieredStorageReader, TieredStorageWriter
from dcp_tiered.planner import _LOCAL_PLANS, planner_for

CACHES = (
    "_cached_save_plan",
    "_cached_all_plans",
    "_cached_global_plan",
    "_cached_final_save_plan",
)


def states(rank: int, i: int) -> dict[str, dict]:
    alike = {f"w{k}": torch.full((4, 8), float(k + i)) for k in range(40)}
    own = {f"r{rank}.{k}": torch.full((16,), float(100 * rank + k + i)) for k in range(30)}
    return {"alike": alike, "mixed": {**alike, **own}}


def plans(key: str) -> dict[str, list]:
    out = {}
    for name in CACHES:
        kept = getattr(SavePlanner, name).get(key)
        if kept is not None:
            out[name] = kept if isinstance(kept, list) else [kept]
    out["ours"] = [_LOCAL_PLANS[key][2]]
    return out


def report(key: str) -> dict:
    found = plans(key)
    items = [i for ps in found.values() for p in ps for i in p.items]
    final = found["_cached_final_save_plan"][0]
    local = found["_cached_save_plan"][0]
    return {
        "local_items": len(local.items),
        "final_items": len(final.items),
        "all_items": sum(len(p.items) for p in found.get("_cached_all_plans", [])),
        "distinct_items": len({id(i) for i in items}),
        "distinct_tensor_data": len({id(i.tensor_data) for i in items}),
        "final_data_from_local": sum(
            any(i.tensor_data is j.tensor_data for j in local.items) for i in final.items
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    found: dict[str, dict] = {}
    for name in ("alike", "mixed"):
        writer = TieredStorageWriter(f"{a.root}/{name}")
        key = planner_for(writer)._cached_plans_key  # a new planner per save, as the manager
        returned = []
        for i in range(3):
            md = dcp.save(
                states(rank, i)[name],
                checkpoint_id=f"step-{i}",
                storage_writer=writer,
                planner=planner_for(writer),
            )
            returned.append(
                [
                    type(md).__name__,
                    md.storage_meta.checkpoint_id if md.storage_meta else None,
                    len(md.storage_data or {}),
                    len(md.state_dict_metadata),
                ]
            )
            got = {k: torch.zeros_like(v) for k, v in states(rank, i)[name].items()}
            dcp.load(
                got,
                checkpoint_id=f"step-{i}",
                storage_reader=TieredStorageReader(f"{a.root}/{name}"),
                planner=TieredLoadPlanner(),
            )
            want = states(rank, i)[name]
            assert all(torch.equal(got[k], want[k]) for k in want), (name, i)
        found[name] = {**report(key), "returned": returned}
        writer.close()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)
    if rank == 0:
        common.write_json(a.out, gathered)
    dist.barrier()
    common.finish()


if __name__ == "__main__":
    main()
