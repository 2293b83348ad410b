"""Per-item cost of the data path: one save, restore and memory snapshot of a state with many
tensors, ours against vanilla DCP (FileSystemWriter/Reader) on the same state in the same run.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/items_profile.py            # 2,000 and 20,000
    PYTHONPATH=$PWD .venv/bin/python benchmarks/items_profile.py --profile  # + top functions

Single process, local root only, page cache warm (the figure is the CPU cost per item, not the
disk). Each phase is the wall time spent inside the storage plugin's own method, so "other" is
DCP's planner and its collectives' no-op single-process versions.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from dcp_tiered.tiers.memory import MemoryTier

PHASES = {
    "save": ("prepare_local_plan", "prepare_global_plan", "write_data", "finish"),
    "load": ("read_metadata", "read_data"),
}


def make_state(count: int, total: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of about ``total`` bytes, sizes spread log-uniformly over three
    decades like a model's weights, biases and norms."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(torch.rand(count, generator=g) * 6.9)  # 1 .. ~1000
    numels = (weights / weights.sum() * (total // 4)).long().clamp(min=1)
    return {
        f"layer{i // 8}.p{i % 8}": torch.randn(int(n), generator=g) for i, n in enumerate(numels)
    }


def timed_methods(obj: Any, names: tuple[str, ...], into: dict[str, float]) -> None:
    """Wrap ``obj``'s methods so each call adds its wall time to ``into[name]``."""
    for name in names:
        method = getattr(obj, name)

        def wrapper(*a: Any, _m: Callable[..., Any] = method, _n: str = name, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _m(*a, **k)
            finally:
                into[_n] = into.get(_n, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)


def run_once(kind: str, state: dict[str, torch.Tensor], work: Path, rep: int, sync: bool) -> dict:
    """One save and one load; returns {phase: seconds}."""
    times: dict[str, float] = {}
    template = {k: torch.empty_like(v) for k, v in state.items()}
    if kind == "ours":
        writer = TieredStorageWriter(work / "ours", sync_files=sync, overwrite=True)
        reader = TieredStorageReader(work / "ours")
        ckpt: Any = f"step-{rep}"
    else:
        ckpt = work / "vanilla" / f"step-{rep}"
        writer = dcp.FileSystemWriter(ckpt, sync_files=sync)
        reader = dcp.FileSystemReader(ckpt)
    save_phases: dict[str, float] = {}
    load_phases: dict[str, float] = {}
    timed_methods(writer, PHASES["save"], save_phases)
    timed_methods(reader, PHASES["load"], load_phases)
    t = time.perf_counter()
    dcp.save(state, storage_writer=writer, checkpoint_id=ckpt, no_dist=True)
    times["save"] = time.perf_counter() - t
    t = time.perf_counter()
    dcp.load(template, storage_reader=reader, checkpoint_id=ckpt, no_dist=True)
    times["load"] = time.perf_counter() - t
    for k, value in state.items():
        if not torch.equal(template[k], value):
            raise AssertionError(f"{kind}: {k} did not round-trip")
    times.update({f"save.{k}": v for k, v in save_phases.items()})
    times.update({f"load.{k}": v for k, v in load_phases.items()})
    return times


def run_memory(tier: MemoryTier, state: dict[str, torch.Tensor], rep: int) -> dict:
    """One snapshot into a slot whose buffer already exists (the steady state of a snapshot
    every step), then its restore."""
    t = time.perf_counter()
    fut = tier.save(f"step-{rep}", {"model": state})
    copy_s = time.perf_counter() - t
    background = fut.result()
    committed = time.perf_counter() - t
    template = {"model": {k: torch.empty_like(v) for k, v in state.items()}}
    t = time.perf_counter()
    tier.load(f"step-{rep}", template)
    load_s = time.perf_counter() - t
    return {
        "snapshot.copy (stall)": copy_s,
        "snapshot.checksum+header": background["write_s"],
        "snapshot.committed": committed,
        "snapshot.load": load_s,
    }


def memcpy_floor(state: dict[str, torch.Tensor]) -> float:
    """One copy of the same bytes between two flat buffers already touched (the stall's
    floor: the snapshot's buffers are reused too)."""
    src = torch.cat([v.view(-1) for v in state.values()])
    flat = torch.empty_like(src)
    flat.copy_(src)  # fault the pages in
    t = time.perf_counter()
    flat.copy_(src)
    return time.perf_counter() - t


def profiled(obj: Any, name: str, prof: cProfile.Profile) -> None:
    """Profile only ``obj.name`` (the plugin's own data path, not DCP's planner)."""
    method = getattr(obj, name)

    def wrapper(*a: Any, **k: Any) -> Any:
        prof.enable()
        try:
            return method(*a, **k)
        finally:
            prof.disable()

    setattr(obj, name, wrapper)


def profile(state: dict[str, torch.Tensor], shm: Path, work: Path, top: int) -> None:
    """cProfile of write_data, read_data and a memory snapshot, on one thread (thread_count=1)
    so that cProfile sees the work."""
    template = {k: torch.empty_like(v) for k, v in state.items()}
    runs: dict[str, cProfile.Profile] = {}
    runs["write_data"] = prof = cProfile.Profile()
    writer = TieredStorageWriter(work / "prof", sync_files=False, overwrite=True, thread_count=1)
    profiled(writer, "write_data", prof)
    dcp.save(state, storage_writer=writer, checkpoint_id="prof", no_dist=True)
    runs["read_data"] = prof = cProfile.Profile()
    reader = TieredStorageReader(work / "prof")
    profiled(reader, "read_data", prof)
    dcp.load(template, storage_reader=reader, checkpoint_id="prof", no_dist=True)
    tier = MemoryTier(shm, 0)
    for warm in range(2):
        tier.save(f"warm-{warm}", {"model": state}).result()
    runs["memory snapshot + restore"] = prof = cProfile.Profile()
    prof.enable()
    tier.save("prof", {"model": state}).result()
    tier.load("prof", {"model": template})
    prof.disable()
    tier.close()
    for what, prof in runs.items():
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out).strip_dirs()
        stats.sort_stats("tottime").print_stats(top)
        print(f"\n--- cProfile, ours, {what} (by own time) ---")
        print("\n".join(out.getvalue().splitlines()[4:]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--counts", type=int, nargs="+", default=[2000, 20000])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-sync", action="store_true", help="no fsync (both writers)")
    p.add_argument("--profile", action="store_true", help="cProfile one save and one load")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    p.add_argument("--shm", default="/dev/shm", help="tmpfs for the memory tier")
    args = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    for count in args.counts:
        state = make_state(count, args.mib * 2**20)
        nbytes = sum(v.numel() * v.element_size() for v in state.values())
        print(f"\n=== {len(state)} tensors, {nbytes / 2**20:.0f} MiB, median of {args.reps} ===")
        with (
            tempfile.TemporaryDirectory(dir=args.dir) as tmp,
            tempfile.TemporaryDirectory(dir=args.shm) as shm,
        ):
            work = Path(tmp)
            samples: dict[str, dict[str, list[float]]] = {"ours": {}, "vanilla": {}, "mem": {}}
            tier = MemoryTier(shm, 0)
            for warm in range(2):  # allocate both slots' buffers
                tier.save(f"warm-{warm}", {"model": state}).result()
            for rep in range(args.reps):
                for kind in ("ours", "vanilla"):  # interleaved: same machine state for both
                    for k, v in run_once(kind, state, work, rep, not args.no_sync).items():
                        samples[kind].setdefault(k, []).append(v)
                for k, v in run_memory(tier, state, rep).items():
                    samples["mem"].setdefault(k, []).append(v)
                samples["mem"].setdefault("memcpy floor", []).append(memcpy_floor(state))
                shutil.rmtree(work / "vanilla", ignore_errors=True)
            tier.close()
            med = {
                kind: {k: statistics.median(v) for k, v in s.items()} for kind, s in samples.items()
            }
            print(f"{'phase':34} {'ours s':>9} {'vanilla s':>10} {'ours/van':>9}")
            for key in med["vanilla"]:
                o, v = med["ours"].get(key), med["vanilla"][key]
                ratio = f"{o / v:9.2f}" if o is not None and v > 0 else " " * 9
                o_s = f"{o:9.3f}" if o is not None else " " * 9
                print(f"{key:34} {o_s} {v:10.3f} {ratio}")
            for key in med["ours"]:
                if key not in med["vanilla"]:
                    print(f"{key:34} {med['ours'][key]:9.3f}")
            for key, v in med["mem"].items():
                print(f"{key:34} {v:9.3f}")
            if args.profile:
                profile(state, Path(shm), work, args.top)


if __name__ == "__main__":
    main()
