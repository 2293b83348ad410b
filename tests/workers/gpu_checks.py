"""The checks that need a GPU: CUDA state through every save path, on an NCCL default group.

    torchrun --nproc_per_node=N tests/workers/gpu_checks.py --root DIR --out F.json [--gib G]

Each rank holds a model-like state on its own GPU (fp32 and bf16, large and small tensors, an
optimizer-like nested dict) and the default process group is NCCL only, as in real training.
Checked, with what each rank saw written to --out:
- ``writer.stage`` (what ``dcp.async_save`` calls on the trainer's thread) puts every tensor in
  pinned host memory (0-d tensors aside: torch stages those in plain memory), bit-exact, and reuses the same pinned buffers on the next save;
- ``dcp.async_save`` then ``dcp.load`` into CUDA targets round-trips bit-exact, with the
  checkpoint collectives on the checkpoint layer's gloo group (NCCL cannot reduce CPU tensors);
- ``CheckpointManager`` (memory every step, disk every 2, async) saves and restores CUDA state
  bit-exact from memory and from disk;
- the stall of ``dcp.async_save`` against a plain device-to-host copy into pinned buffers of
  the same state (``--gib`` GiB; the figure, not a pass/fail);
- a plain synchronous ``dcp.save`` of CUDA state that the caller did not stage (a transposed
  and a strided tensor, 2,000 small ones) loads back bit-exact into CUDA targets;
- the memory tier with 2,000 small CUDA tensors restores bit-exact; its snapshot until valid
  beside a copy into pinned buffers (the figure).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_tiered import (
    CheckpointManager,
    Every,
    SavePolicy,
    TieredLoadPlanner,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)
from dcp_tiered.planner import planner_for

warnings.filterwarnings("ignore")


def state(device: torch.device, rank: int, nbytes: int) -> dict:
    gen = torch.Generator(device=device).manual_seed(rank)
    big = max(1, nbytes // 4 // 8)
    model = {f"layer{i}.weight": torch.randn(big, device=device, generator=gen) for i in range(8)}
    model.update(
        {
            f"layer{i}.norm": torch.randn(256, device=device, generator=gen).bfloat16()
            for i in range(200)
        }
    )
    optim = {
        "state": {
            f"{i}": {
                "exp_avg": torch.randn(1024, device=device, generator=gen),
                "step": torch.tensor(float(i), device=device),
            }
            for i in range(100)
        }
    }
    return {"model": model, "optim": optim}


def flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def same(a: dict, b: dict) -> bool:
    fa, fb = flat(a), flat(b)
    return fa.keys() == fb.keys() and all(
        torch.equal(fa[k].cpu(), fb[k].cpu()) and fb[k].device == fa[k].device for k in fa
    )


def zeros_like(tree: dict) -> dict:
    return {
        k: zeros_like(v) if isinstance(v, dict) else torch.zeros_like(v) for k, v in tree.items()
    }


def loaded(like: dict, directory: Path, step: str, pg) -> dict:
    """Step ``step`` of our root ``directory`` loaded into zeros shaped like ``like``."""
    target = zeros_like(like)
    dcp.load(
        target,
        checkpoint_id=step,
        storage_reader=TieredStorageReader(directory),
        planner=TieredLoadPlanner(),
        process_group=pg,
    )
    return target


def pinned_copy_secs(pinned: dict, tensors: dict) -> float:
    """Seconds of a device-to-host copy of ``tensors`` into their ``pinned`` buffers."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for k, v in tensors.items():
        pinned[k].copy_(v, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--gib", type=float, default=1.0)
    a = p.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)  # NCCL only: no CPU collectives
    rank = dist.get_rank()
    seen: dict = {
        "rank": rank,
        "backend": str(dist.get_backend()),
        "gpu": torch.cuda.get_device_name(),
    }
    pg = checkpoint_process_group()
    src = state(device, rank, int(a.gib * 2**30))
    root = Path(a.root)

    # 1. staging: pinned, exact, reused
    writer = TieredStorageWriter(root / "dcp")
    staged = writer.stage(src)
    flat_staged = flat(staged)
    seen["staged_on_cpu"] = all(t.device.type == "cpu" for t in flat_staged.values())
    # torch's own buffers for 0-d tensors are plain (create_cpu_state_dict): pinning
    # matters, and is asked for, for the rest
    seen["staged_pinned"] = all(t.is_pinned() for t in flat_staged.values() if t.dim())
    seen["staged_scalars"] = sum(1 for t in flat_staged.values() if not t.dim())
    seen["staged_exact"] = all(torch.equal(t, flat(src)[k].cpu()) for k, t in flat_staged.items())
    writer.close()

    # 2. async_save + load into CUDA targets, on an NCCL default group
    writer = TieredStorageWriter(root / "dcp")
    planner = planner_for(writer)
    ptrs = []
    for step in ("step-1", "step-2", "step-3"):
        fut = dcp.async_save(
            src, checkpoint_id=step, storage_writer=writer, planner=planner, process_group=pg
        )
        fut.result()
    seen["async_save_load_exact"] = same(src, loaded(src, root / "dcp", "step-3", pg))

    # 3. the stall against a plain device-to-host copy into pinned buffers
    pinned = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for k, t in flat(src).items()}
    copies, stalls = [], []
    for i in range(4):
        copies.append(pinned_copy_secs(pinned, flat(src)))
        dist.barrier(group=pg)
        t = time.perf_counter()
        fut = dcp.async_save(
            src,
            checkpoint_id=f"stall-{i}",
            storage_writer=writer,
            planner=planner,
            process_group=pg,
        )
        stalls.append(time.perf_counter() - t)
        fut.result()
        ptrs.append(sorted(t.data_ptr() for t in flat(writer.stage(src)).values())[:3])
    writer.close()
    seen["d2h_copy_s"] = sorted(copies)[1:3]
    seen["async_save_stall_s"] = sorted(stalls)[1:3]
    seen["stall_over_copy"] = sorted(stalls)[1] / sorted(copies)[1]
    seen["bytes"] = sum(t.numel() * t.element_size() for t in flat(src).values())

    # 4. the manager: memory every step, disk every 2; restore from memory, then from disk
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=None)
    shm = f"/dev/shm/dcp-tiered-gpu-{os.getpid()}"  # both removed at the end
    with CheckpointManager(memory=shm, local=root / "mgr", policy=policy, events=None) as mgr:
        saves = []
        for step in range(1, 5):
            for t in flat(src["model"]).values():
                t.add_(1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            mgr.save(step, {"train": src})
            saves.append(time.perf_counter() - t0)
        mgr.wait()
        seen["manager_save_stall_s"] = saves
        target = {"train": zeros_like(src)}
        restored = mgr.restore(target)
        seen["manager_restored"] = str(restored)
        seen["manager_exact"] = same(src, target["train"])
    with CheckpointManager(local=root / "mgr", events=None) as mgr:
        target = {"train": zeros_like(src)}
        restored = mgr.restore(target)
        seen["disk_restored"] = str(restored)
        seen["disk_exact"] = same(src, target["train"])

    # 5. a plain synchronous dcp.save of CUDA state (no staging by the caller), with a
    # non-contiguous tensor and many small ones, loaded back into CUDA targets
    odd = dict(src["model"])
    odd["transposed"] = torch.randn(96, 64, device=device).t()
    odd["strided"] = torch.randn(64, 64, device=device)[::2, 1:]
    odd.update({f"small{i}": torch.randn(33, device=device) for i in range(2000)})
    writer = TieredStorageWriter(root / "sync")
    dcp.save(odd, checkpoint_id="step-1", storage_writer=writer, process_group=pg)
    writer.close()
    seen["sync_save_load_exact"] = same(odd, loaded(odd, root / "sync", "step-1", pg))

    # 6. the memory tier with many small CUDA tensors: exact, and its stall beside a copy
    many = {f"p{i}": torch.randn(4096, device=device) for i in range(2000)}
    pinned = {k: torch.empty_like(t, device="cpu", pin_memory=True) for k, t in many.items()}
    many_shm = f"/dev/shm/dcp-tiered-gpu-many-{os.getpid()}"
    policy = SavePolicy(memory=Every(steps=1), local=None, remote=None)
    copies, snaps = [], []
    with CheckpointManager(memory=many_shm, local=root / "many", policy=policy, events=None) as mgr:
        for step in range(1, 6):
            for t in many.values():
                t.add_(1)
            copies.append(pinned_copy_secs(pinned, many))
            t0 = time.perf_counter()
            mgr.save(step, {"train": many})
            mgr.wait()
            snaps.append(time.perf_counter() - t0)
        target = {"train": zeros_like(many)}
        seen["many_restored"] = str(mgr.restore(target))
        seen["many_exact"] = same(many, target["train"])
    seen["many_copy_s"] = sorted(copies)[1:3]
    seen["many_snapshot_s"] = sorted(snaps)[1:3]
    seen["many_snapshot_over_copy"] = sorted(snaps)[1] / sorted(copies)[1]

    for used in (shm, many_shm):  # memory-tier slots: shared memory until removed
        shutil.rmtree(used, ignore_errors=True)
    dist.barrier(group=pg)
    Path(f"{a.out}.{rank}").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
