"""Scale harness: the coordinator's work and the metadata sizes at N ranks, without N processes.

Replays the real code paths of one save and one restore for N simulated ranks in one process,
with synthetic model-shaped state (Llama-3-8B / 70B parameters with Adam's exp_avg/exp_avg_sq
and step, FSDP2 dim-0 sharding or FSDP2 + TP 8, 8 ranks per node):

    every rank   DefaultSavePlanner.create_local_plan -> TieredStorageWriter.prepare_local_plan
    rank 0       DefaultSavePlanner.create_global_plan -> TieredStorageWriter.prepare_global_plan
    every rank   DefaultSavePlanner.finish_plan; WriteResults built as _write_file builds them
                 (same file split, names and ItemLocations; no bytes are written)
    rank 0       describe (manifest_build.build, vanilla_metadata), commit.write_step_files, Handshake.coordinate
    one rank     manifest.parse, DefaultLoadPlanner's local plan, reader.prepare_local_plan

and the same layouts through vanilla DCP (DefaultSavePlanner + FileSystemWriter), with and
without ``enable_plan_caching``. No process group: DCP's gather/scatter are replaced by lists
(their payload is measured as the pickled size of what each rank would send). The state's
objects implement DCP's ``__create_write_items__``/``__create_chunk_list__`` hooks (as DTensor
does), so DCP's planners run unchanged. S3 requests and handshake store operations are counted
from a model of the code (``s3_model``), stated in docs/scale.md.

    .venv/bin/python benchmarks/scale.py                # 16 and 64 ranks, 8B FSDP2, ~2 min
    .venv/bin/python benchmarks/scale.py --ranks 64,256,1024 --shardings fsdp2 --no-memory \
        --json scale.json                               # the curves of docs/scale.md
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import io
import json
import math
import multiprocessing
import os
import pickle
import platform
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from typing_extensions import Self

from dcp_tiered import (
    TieredSavePlanner,
    TieredStorageReader,
    TieredStorageWriter,
    _torch_compat,
)
from dcp_tiered._version import __version__
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.errors import ConfigError
from dcp_tiered.item_writer import split_by_size
from dcp_tiered.policy import integrity, layout, manifest, manifest_build
from dcp_tiered.tiers import commit
from dcp_tiered.tiers.root import Tiers
from dcp_tiered.writer import _planned_bytes
from dcp_tiered.writer._describe import describe
from dcp_tiered.writer._plan import SaveInfo

MiB, GiB = 2**20, 2**30
RANKS_PER_NODE = 8

# ---------------------------------------------------------------- model layouts

MODELS = {
    # Llama-3 shapes (vocab 128,256, GQA with 8 KV heads of 128).
    "llama3-8b": {"vocab": 128256, "dim": 4096, "layers": 32, "ffn": 14336, "kv": 1024},
    "llama3-70b": {"vocab": 128256, "dim": 8192, "layers": 80, "ffn": 28672, "kv": 1024},
    "tiny": {"vocab": 512, "dim": 64, "layers": 2, "ffn": 128, "kv": 32},  # the smoke test's
}


def parameters(model: str) -> list[tuple[str, tuple[int, ...], int | None]]:
    """(fqn, global shape, TP shard dim or None for replicated) as torchtitan's Llama plan."""
    m = MODELS[model]
    d, kv, f = m["dim"], m["kv"], m["ffn"]
    out: list[tuple[str, tuple[int, ...], int | None]] = [
        ("tok_embeddings.weight", (m["vocab"], d), 0)
    ]
    for i in range(m["layers"]):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (d, d), 0),
            (p + "attention.wk.weight", (kv, d), 0),
            (p + "attention.wv.weight", (kv, d), 0),
            (p + "attention.wo.weight", (d, d), 1),
            (p + "feed_forward.w1.weight", (f, d), 0),
            (p + "feed_forward.w2.weight", (d, f), 1),
            (p + "feed_forward.w3.weight", (f, d), 0),
            (p + "attention_norm.weight", (d,), None),
            (p + "ffn_norm.weight", (d,), None),
        ]
    out += [("norm.weight", (d,), None), ("output.weight", (m["vocab"], d), 0)]
    return out


def _piece(start: int, length: int, parts: int, i: int) -> tuple[int, int]:
    """torch.chunk's split of [start, start+length) into ``parts``: piece ``i`` (maybe empty)."""
    size = -(-length // parts)
    off = min(i * size, length)
    return start + off, max(0, min(size, length - off))


def local_chunk(
    shape: tuple[int, ...], tp_dim: int | None, rank: int, world: int, tp: int
) -> tuple[list[int], list[int]]:
    """The chunk rank ``rank`` holds: TP split of ``tp_dim`` over the 8 ranks of a node, then
    FSDP2's dim-0 split over the data-parallel ranks (what _StridedShard resolves to)."""
    offsets, sizes = [0] * len(shape), list(shape)
    dp, dp_rank, tp_rank = world // tp, rank // tp, rank % tp
    if tp > 1 and tp_dim is not None:
        offsets[tp_dim], sizes[tp_dim] = _piece(0, shape[tp_dim], tp, tp_rank)
    offsets[0], sizes[0] = _piece(offsets[0], sizes[0], dp, dp_rank)
    return offsets, sizes


class Shard:
    """One rank's shard of a DTensor, as DCP's planners see it (DTensor's _Checkpointable)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        offsets: list[int],
        sizes: list[int],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.shape, self.offsets, self.sizes, self.dtype = shape, offsets, sizes, dtype

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        offsets = torch.Size(self.offsets)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(self.sizes)),
                    properties=TensorProperties(dtype=self.dtype),
                    size=torch.Size(self.shape),
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [
            ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=torch.Size(self.sizes))
        ]


def state_of_rank(model: str, rank: int, world: int, tp: int) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` as get_state_dict returns it for FSDP2 (+TP) and Adam."""
    params = parameters(model)
    msd, ostate = {}, {}
    step = torch.tensor(100.0)  # Adam's step: a plain tensor on every rank (DCP dedups it)
    for fqn, shape, tp_dim in params:
        off, sz = local_chunk(shape, tp_dim, rank, world, tp)
        msd[fqn] = Shard(shape, off, sz)
        ostate[fqn] = {
            "step": step,
            "exp_avg": Shard(shape, off, sz),
            "exp_avg_sq": Shard(shape, off, sz),
        }
    groups = [
        {
            "lr": 3e-4,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "weight_decay": 0.1,
            "amsgrad": False,
            "foreach": None,
            "maximize": False,
            "capturable": False,
            "differentiable": False,
            "fused": None,
            "params": [p[0] for p in params],
        }
    ]
    return {"model": msd, "optim": {"state": ostate, "param_groups": groups}}


def state_bytes(model: str) -> int:
    return sum(3 * 4 * math.prod(s) for _, s, _ in parameters(model))


# ---------------------------------------------------------------- what _write_file would write


def _framing() -> tuple[int, int]:
    """torch.save's framing around a tensor's bytes, and where the raw bytes start, measured
    once through the writer's own path (ChecksummingWriter + save_tensor)."""
    out = integrity.ChecksummingWriter(io.BytesIO())
    start = out.start_item()
    t = torch.zeros(1000, 10)
    _torch_compat.save_tensor(t, out)
    length = out.position - start
    raw = out.raw_offset(start, t.numel() * t.element_size())
    return length - t.numel() * t.element_size(), raw or 0


def _bytes_len(obj: Any) -> int:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.tell()


def _fake_crc(*parts: Any) -> str:
    return integrity.format_checksum(zlib.crc32(repr(parts).encode()))


def write_results(
    plan: SavePlan,
    rank: int,
    thread_count: int,
    framing: tuple[int, int],
    planner: DefaultSavePlanner,
    ours: bool,
) -> list[WriteResult]:
    """The WriteResults ``write_data`` returns for ``plan`` (ours: _write_file's ItemLocations
    over split_by_size's files; vanilla: FileSystemWriter's _StorageInfo, one file)."""
    overhead, raw = framing
    buckets = (
        split_by_size(plan.items, thread_count, _planned_bytes) if ours else [list(plan.items)]
    )
    out = []
    for i, bucket in enumerate(buckets):
        name = layout.data_file_name(rank, i)
        placed, pos = [], 0
        for item in bucket:
            if item.type == WriteItemType.BYTE_IO:
                length, raw_off = _bytes_len(planner.lookup_object(item.index)), None
            else:
                td = item.tensor_data
                length = math.prod(td.chunk.sizes) * td.properties.dtype.itemsize + overhead
                raw_off = raw
            placed.append((item.index, pos, length, raw_off))
            pos += length
        file_crc = _fake_crc(rank, i, pos)
        for index, offset, length, raw_off in placed:
            if ours:
                data: Any = manifest.ItemLocation(
                    relative_path=name,
                    offset=offset,
                    length=length,
                    checksum=_fake_crc(index, offset),
                    rank=rank,
                    file_size=pos,
                    file_checksum=file_crc,
                    raw_offset=raw_off,
                )
            else:
                data = _StorageInfo(name, offset, length)
            out.append(WriteResult(index=index, size_in_bytes=length, storage_data=data))
    return out


# ---------------------------------------------------------------- a c10d store that counts


class CountingStore:
    """An in-memory stand-in for the c10d store: counts operations and bytes by kind."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.ops = {"set": 0, "get": 0, "wait": 0, "multi_set": 0, "multi_get": 0}
        self.bytes_set = self.bytes_get = 0
        self.cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self.cond:
            self.ops["set"] += 1
            self.bytes_set += len(value)
            self.data[key] = value
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            self.ops["get"] += 1
            self.bytes_get += len(self.data[key])
            return self.data[key]

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        with self.cond:
            self.ops["wait"] += 1
            if not self.cond.wait_for(lambda: all(k in self.data for k in keys), 30):
                raise RuntimeError(f"wait timed out for {keys}")

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            return all(k in self.data for k in keys)

    def has_extended_api(self) -> bool:
        return True

    def multi_set(self, keys: list[str], values: list[bytes]) -> None:
        with self.cond:
            self.ops["multi_set"] = self.ops.get("multi_set", 0) + 1
            for k, v in zip(keys, values):
                self.bytes_set += len(v)
                self.data[k] = v
            self.cond.notify_all()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        with self.cond:
            self.ops["multi_get"] = self.ops.get("multi_get", 0) + 1
            out = [self.data[k] for k in keys]
            self.bytes_get += sum(len(v) for v in out)
            return out


def handshake_ops(nodes: int, built: manifest_build.Built) -> dict[str, Any]:
    """Run the real Handshake: the coordinator against every other node's answers, and one
    follower node for its own operations (each follower does the same)."""
    store = CountingStore()
    hs = commit.Handshake(store, "scale", 60)
    prefix = "dcp_tiered/commit/scale/"
    for n in range(1, nodes):
        store.data[f"{prefix}prepared/{n}"] = b"ok"
        store.data[f"{prefix}done/{n}"] = b"ok"
    coord = dict(store.ops)
    if nodes > 1:
        hs.coordinate(list(range(1, nodes)), built.index, built.sections, lambda: None)
    coord = {k: store.ops[k] - coord[k] for k in coord}
    out: dict[str, Any] = {
        "coordinator_ops": sum(coord.values()),
        "coordinator_by_kind": coord,
        "coordinator_bytes_set": store.bytes_set,
    }
    if nodes > 1:
        before, got_before = dict(store.ops), store.bytes_get
        done = threading.Event()
        t = commit.Handshake(store, "scale", 60).follow_in_background(
            1, lambda index, shared, own: None, done.set, lambda why: done.set()
        )
        t.join(30)
        per = {k: store.ops[k] - before[k] for k in before}
        out.update(
            follower_ops=sum(per.values()),
            follower_by_kind=per,
            follower_bytes_get=store.bytes_get - got_before,
            total_ops=out["coordinator_ops"] + (nodes - 1) * sum(per.values()),
            total_bytes_through_store=store.bytes_set
            + (nodes - 1) * (store.bytes_get - got_before),
        )
    else:
        out.update(follower_ops=0, total_ops=out["coordinator_ops"], total_bytes_through_store=0)
    return out


# ---------------------------------------------------------------- S3 request model


def s3_model(
    world: int,
    file_sizes: list[int],
    manifest_len: int,
    metadata_len: int,
    *,
    part_size: int = 16 * MiB,
    prefix_strategy: str = "none",
    hash_prefixes: int = 16,
    verify_uploads: bool = True,
    retained_steps: int = 5,
    read_range: int = 64 * MiB,
    shared_resolve: bool = False,
) -> dict[str, Any]:
    """S3 requests of one save and one restore, by kind, derived from the code (see
    docs/scale.md "S3 requests"): writer.upload_early/tiers.uploads, tiers.promotion.Promotion,
    reader.TieredStorageReader and tiers.catalog; tests/test_s3_requests.py counts them on
    the wire for a small save. Assumes every early upload succeeds (so promotion trusts its
    ``.done`` records and sends nothing per file), the coordinator's first poll finds every
    node record, no orphan saves, and a restore of ``latest`` on fresh nodes (nothing
    local) at the same world size. ``shared_resolve``: 'latest' resolved by rank 0 and
    shared (``CheckpointManager.restore`` and the Megatron facade list the tiers on rank 0),
    else by every rank (a ``TieredStorageReader`` on its own). ``retained_steps`` no
    longer matters: nothing lists the steps while the ``latest`` pointer is valid."""
    nodes = -(-world // RANKS_PER_NODE)
    # data, node records, manifest, .metadata, marker (+ the root's latest pointer, shared)
    objects = len(file_sizes) + nodes + 3
    pages = lambda n: max(1, -(-n // 1000))
    save: dict[str, int] = {
        "PUT": 0,
        "multipart_create": 0,
        "multipart_parts": 0,
        "multipart_complete": 0,
        "HEAD": 0,
        "GET": 0,
        "LIST": 0,
    }
    for size in file_sizes:
        # upload_early -> upload_verified -> RemoteBackend.put_file (s3fs, chunksize=part_size)
        if size <= part_size:
            save["PUT"] += 1
        else:
            save["multipart_create"] += 1
            save["multipart_parts"] += -(-size // part_size)
            save["multipart_complete"] += 1
        if verify_uploads:  # remote_checksum(read_back=True): one streamed GET, no HEAD
            save["GET"] += 1
    save["GET"] += nodes  # the marker, once per node (Uploader._remote_step_free)
    # Promotion.run on each node's leader: marker GET, no listing, its node record.
    save["GET"] += nodes
    save["PUT"] += nodes
    # The coordinator's node commits: one LIST of _nodes/ per poll round, manifest and
    # .metadata PUTs, the latest pointer (GET + conditional PUT), the exclusive marker PUT;
    # remove_orphan_saves: one delimited listing per step prefix, nothing more without orphans.
    save["LIST"] += pages(nodes)
    save["PUT"] += 2 + 1 + 1
    save["GET"] += 1
    save["LIST"] += 1 + (hash_prefixes if prefix_strategy == "hash" else 0)
    restore: dict[str, int] = {"GET": 0, "LIST": 0, "HEAD": 0}
    # Per rank: the start-up probe (LIST, MaxKeys=1); 'latest': pointer + its marker (once per
    # job when shared); the reader's _load_manifest reads the marker again and the manifest;
    # the first remote data read reads the marker once more.
    resolvers = 1 if shared_resolve else world
    restore["LIST"] += world
    restore["GET"] += resolvers * 2 + world * (1 + 1 + 1)
    data_gets = sum(max(1, -(-size // read_range)) for size in file_sizes)
    restore["GET"] += data_gets  # each rank's own files, coalesced ranges <= 64 MiB
    restore_bytes_metadata = world * manifest_len
    save_total = sum(save.values())
    data = sum(file_sizes)
    minimum = sum(1 if s <= part_size else -(-s // part_size) + 2 for s in file_sizes)
    return {
        "objects_per_step": objects,
        "save_requests": save,
        "save_requests_total": save_total,
        "save_requests_per_gib": save_total / max(data / GiB, 1e-9),
        "save_requests_minimum_for_part_size": minimum + 3,
        "save_requests_vs_minimum": save_total / (minimum + 3),
        "restore_requests": restore,
        "restore_requests_total": sum(restore.values()),
        "restore_metadata_bytes_all_ranks": restore_bytes_metadata,
        "restore_metadata_bytes_per_rank": manifest_len,
        "restore_data_bytes_per_rank": data // world,
        "metadata_object_bytes": manifest_len + metadata_len,
    }


def prefixes_needed(
    nodes: int, node_bandwidth: float, part_size: int, read_range: int = 64 * MiB
) -> dict[str, int]:
    """RemoteConfig.hash_prefixes's sizing rule: the parts all nodes send per second over
    S3's 3,500 PUTs per second per prefix; a restore's ranged GETs over its 5,500 GETs."""
    rate = nodes * node_bandwidth
    return {
        "put": math.ceil(rate / part_size / 3500),
        "get": math.ceil(rate / read_range / 5500),
    }


# ---------------------------------------------------------------- one configuration


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _pickled_all(objs: list[Any], sample: int = 32) -> int:
    """Bytes every rank sends (DCP's gather pickles each rank's object): exact up to ``sample``
    ranks, else rank 0 plus evenly spaced ranks, scaled (ranks' plans differ little)."""
    if len(objs) <= sample:
        return sum(_pickled(o) for o in objs)
    picks = sorted({0} | {round(i * (len(objs) - 1) / (sample - 1)) for i in range(sample)})
    rest = [_pickled(objs[i]) for i in picks if i != 0]
    return _pickled(objs[0]) + round(sum(rest) / len(rest) * (len(objs) - 1))


def _clear_plan_cache() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.clear()


class _Traced:
    """Peak Python heap allocated inside the block (tracemalloc), when enabled."""

    def __init__(self, on: bool) -> None:
        self.on, self.peak = on, None

    def __enter__(self) -> Self:
        if self.on:
            gc.collect()
            tracemalloc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()


def local_plans(
    model: str, world: int, tp: int, make_planner: Any, prepare: Any
) -> tuple[list[SavePlan], list[DefaultSavePlanner], float]:
    """Every rank's create_local_plan + storage writer's prepare_local_plan."""
    plans, planners, spent = [], [], 0.0
    for rank in range(world):
        planner = make_planner(rank)
        planner.set_up_planner(state_of_rank(model, rank, world, tp), None, rank == 0)
        started = time.perf_counter()
        plan = prepare(rank, planner.create_local_plan())
        spent += time.perf_counter() - started
        plans.append(plan)
        planners.append(planner)
    return plans, planners, spent / world


def run_ours(
    model: str,
    world: int,
    tp: int,
    work: Path,
    thread_count: int,
    framing: tuple[int, int],
    trace: bool,
) -> dict[str, Any]:
    nodes = -(-world // RANKS_PER_NODE)
    writers = []
    for n in range(nodes):
        tiers = Tiers.open(work / f"node{n}")
        w = TieredStorageWriter(
            tiers,
            sync_files=False,
            thread_count=thread_count,
            collective_timeout_warn_secs=None,
        )
        # The node's disk must hold the simulated state: report ample free space (the only
        # I/O probe replaced; every other call is the writer's own).
        tiers.local.backend.free_bytes = lambda: 1 << 62  # type: ignore[method-assign]
        w.reset("step-1")
        w.storage_meta()
        w.set_up_storage_writer(n == 0, rank=n * RANKS_PER_NODE, use_collectives=True)
        writers.append(w)
    coord = writers[0]
    out: dict[str, Any] = {}
    with _Traced(trace) as mem:
        plans, planners, per_rank = local_plans(
            model,
            world,
            tp,
            lambda r: TieredSavePlanner(),
            lambda r, p: writers[r // RANKS_PER_NODE].prepare_local_plan(p),
        )
        out["local_plan_s_per_rank"] = per_rank
        out["gathered_bytes"] = _pickled_all(plans) if not trace else None
        started = time.perf_counter()
        global_plans, metadata = planners[0].create_global_plan(plans)
        # The coordinator hands each save's facts to the other ranks through the c10d store.
        facts_store = CountingStore()
        real_store, _torch_compat.default_store = _torch_compat.default_store, lambda: facts_store
        try:
            global_plans = coord.prepare_global_plan(global_plans)
        finally:
            _torch_compat.default_store = real_store
        out["plan_s"] = time.perf_counter() - started
        out["facts_store_bytes"] = facts_store.bytes_set
        out["scattered_bytes"] = _pickled_all(global_plans) if not trace else None
        del plans
        results = []
        for rank, (planner, gp) in enumerate(zip(planners, global_plans)):
            final = planner.finish_plan(gp)
            results.append(write_results(final, rank, thread_count, framing, planner, True))
        out["results_gathered_bytes"] = _pickled_all(results) if not trace else None
        lay, save = global_plans[0].storage_data, coord._facts
        # finish(): what it computes, then the files it writes and the node handshake.
        started = time.perf_counter()
        timings: dict[str, float] = {}
        built, metadata_bytes = describe(SaveInfo(lay, save), metadata, results, timings)
        build_s, pickle_s = timings["manifest_build_s"], timings["metadata_pickle_s"]
        locations = {wr.index: wr.storage_data for rs in results for wr in rs}
        tmp = work / "node0" / layout.tmp_dir_name(save.step, save.save_id)
        tmp.mkdir(parents=True, exist_ok=True)
        files = {layout.DCP_METADATA_NAME: metadata_bytes, **built.files_for(None)}
        commit.write_step_files(LocalBackend(work / "node0"), tmp.name, files, sync=False)
        hs = handshake_ops(nodes, built)
        out["commit_s"] = time.perf_counter() - started
    shared = len(built.sections[manifest.SHARED])
    sections = [len(b) for n, b in built.sections.items() if n != manifest.SHARED]
    manifest_bytes = len(built.index) + shared + sum(sections)
    out["coordinator_peak_bytes"] = mem.peak
    out.update(
        manifest_build_s=build_s,
        metadata_pickle_s=pickle_s,
        manifest_bytes=manifest_bytes,
        manifest_index_bytes=len(built.index),
        manifest_section_bytes_max=max(sections),
        manifest_shared_section_bytes=shared,
        metadata_bytes=len(metadata_bytes),
        # The coordinator's node: index, every section, .metadata; any other: index, its own.
        manifest_bytes_all_node_copies=manifest_bytes
        + len(metadata_bytes)
        + sum(len(built.index) + shared + n for n in sections[1:]),
        items=len(locations),
        handshake=hs,
    )
    file_sizes = sorted({(loc.relative_path, loc.file_size) for loc in locations.values()})
    out["files_per_step"] = len(file_sizes)
    out["file_sizes"] = [s for _, s in file_sizes]
    del results, global_plans, planners
    # The restore: the last rank parses the index, plans its reads, and merges the sections
    # that locate them (the reader's _locate), as on a fresh node.
    gc.collect()
    with _Traced(trace) as rmem:
        started = time.perf_counter()
        parsed = manifest.parse(built.index, where="scale")
        out["reader_parse_s"] = time.perf_counter() - started
        reader = TieredStorageReader(work / "node0")
        started = time.perf_counter()
        flat, _ = _flatten(state_of_rank(model, world - 1, world, tp))
        load_plan = reader.prepare_local_plan(
            create_default_local_load_plan(flat, parsed.metadata, strict=False)
        )
        needed = manifest.needed_sections(parsed, [i.storage_index for i in load_plan.items])
        for node in needed:
            parsed = manifest.parse_section(parsed, node, built.sections[node], where="scale")
        out["reader_plan_s"] = time.perf_counter() - started
    out["reader_sections_read"] = len(needed)
    out["restore_metadata_bytes_per_rank"] = len(built.index) + sum(
        len(built.sections[n]) for n in needed
    )
    out["reader_peak_bytes"] = rmem.peak
    out["reader_read_items"] = len(load_plan.items)
    for w in writers:
        w.close()
    return out


def _flatten(state: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def run_vanilla(
    model: str,
    world: int,
    tp: int,
    work: Path,
    framing: tuple[int, int],
    caching: bool,
    trace: bool,
) -> dict[str, Any]:
    """DefaultSavePlanner + FileSystemWriter on the same layout (twice with plan caching: the
    second save is the repeat whose planning caching saves)."""
    _clear_plan_cache()
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")  # save 2
    writer = FileSystemWriter(work / "vanilla", sync_files=False)
    writer.reset()
    writer.set_up_storage_writer(True, rank=0, use_collectives=True)
    out: dict[str, Any] = {}
    saves = 2 if caching else 1
    planners_by_rank: dict[int, DefaultSavePlanner] = {}

    def make(rank: int) -> DefaultSavePlanner:
        p = DefaultSavePlanner(enable_plan_caching=caching)
        p._cached_plans_key = f"rank{rank}"  # the class-level cache is per process: per rank
        planners_by_rank[rank] = p
        return p

    for n in range(saves):
        with _Traced(trace and n == 0) as mem:
            plans, planners, per_rank = local_plans(
                model, world, tp, make, lambda r, p: writer.prepare_local_plan(p)
            )
            gathered = _pickled_all(plans) if not trace else None
            started = time.perf_counter()
            global_plans, metadata = planners[0].create_global_plan(plans)
            global_plans = writer.prepare_global_plan(global_plans)
            plan_s = time.perf_counter() - started
            scattered = _pickled_all(global_plans) if not trace else None
            del plans
            results = []
            for rank, (planner, gp) in enumerate(zip(planners, global_plans)):
                final = planner.finish_plan(gp)
                results.append(write_results(final, rank, 1, framing, planner, False))
            started = time.perf_counter()
            writer.finish(metadata, results)
            commit_s = time.perf_counter() - started
        key = "" if n == 0 else "repeat_"
        out[f"{key}local_plan_s_per_rank"] = per_rank
        out[f"{key}plan_s"], out[f"{key}commit_s"] = plan_s, commit_s
        out[f"{key}gathered_bytes"], out[f"{key}scattered_bytes"] = gathered, scattered
        if n == 0:
            out["coordinator_peak_bytes"] = mem.peak
            out["metadata_bytes"] = (work / "vanilla" / ".metadata").stat().st_size
            out["results_gathered_bytes"] = _pickled_all(results) if not trace else None
        del results, global_plans, planners
    _clear_plan_cache()
    return out


def ours_with_caching(work: Path) -> str:
    """What our writer says to DefaultSavePlanner(enable_plan_caching=True) on a repeat save."""
    w = TieredStorageWriter(work / "cache", sync_files=False, collective_timeout_warn_secs=None)
    w.reset("step-2")
    w.set_up_storage_writer(True, rank=0, use_collectives=True)
    try:
        w.prepare_local_plan(SavePlan([], usable=False))
    except ConfigError as e:
        return f"refused: {type(e).__name__}"
    finally:
        w.close()
    return "accepted"


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    with concurrent.futures.ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn")
    ) as pool:
        return pool.submit(fn, *args).result()


def _fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's results with each time (``*_s``) the least of all runs'."""
    out = dict(runs[0])
    for key, value in out.items():
        if key.endswith("_s") and isinstance(value, float):
            out[key] = min(r[key] for r in runs)
    return out


def run_config(
    model: str, sharding: str, world: int, args: argparse.Namespace, framing: tuple[int, int]
) -> dict[str, Any]:
    tp = 8 if sharding == "fsdp2+tp8" else 1
    work = Path(tempfile.mkdtemp(prefix="dcp-tiered-scale-", dir=args.dir))
    try:
        # Each in a process of its own, as a coordinator is: the garbage collector's work
        # depends on what the process allocated before (in one process, whichever ran
        # second paid for the first's leftovers: 1.5 s against 0.9 s of the same planning).
        # With enable_plan_caching the first save runs the same code as without it (the
        # cache is empty; _create_global_plan_with_caching only stores its results), so its
        # first save is the uncached baseline and its second the cached repeat. --repeat
        # alternates the two and keeps each one's fastest time (a shared machine's noise).
        ours_runs, cached_runs = [], []
        for i in range(args.repeat):
            ours_runs.append(
                _in_fresh_process(
                    run_ours, model, world, tp, work / f"ours{i}", args.thread_count, framing, False
                )
            )
            cached_runs.append(
                _in_fresh_process(
                    run_vanilla, model, world, tp, work / f"vc{i}", framing, True, False
                )
            )
        ours, cached = _fastest(ours_runs), _fastest(cached_runs)
        vanilla = {k: v for k, v in cached.items() if not k.startswith("repeat_")}
        gc.collect()
        if args.memory:
            traced = run_ours(
                model, world, tp, work / "ours-traced", args.thread_count, framing, True
            )
            ours["coordinator_peak_bytes"] = traced["coordinator_peak_bytes"]
            ours["reader_peak_bytes"] = traced["reader_peak_bytes"]
            gc.collect()
            vanilla["coordinator_peak_bytes"] = run_vanilla(
                model, world, tp, work / "v-traced", framing, False, True
            )["coordinator_peak_bytes"]
            gc.collect()
        file_sizes = ours.pop("file_sizes")
        s3 = {
            strategy: s3_model(
                world,
                file_sizes,
                ours["restore_metadata_bytes_per_rank"],
                ours["metadata_bytes"],
                part_size=args.part_size_mib * MiB,
                prefix_strategy=strategy,
                hash_prefixes=args.hash_prefixes,
                retained_steps=args.retained_steps,
            )
            for strategy in ("none", "hash")
        }
        ours["caching"] = ours_with_caching(work)
        return {
            "model": model,
            "sharding": sharding,
            "world": world,
            "nodes": -(-world // RANKS_PER_NODE),
            "state_bytes": state_bytes(model),
            "ours": ours,
            "vanilla": vanilla,
            "vanilla_cached": cached,
            "s3": s3,
            "ratios": {
                "plan_commit_vs_vanilla": (ours["plan_s"] + ours["commit_s"])
                / (vanilla["plan_s"] + vanilla["commit_s"]),
                "metadata_bytes_vs_vanilla": (ours["manifest_bytes"] + ours["metadata_bytes"])
                / vanilla["metadata_bytes"],
                "manifest_vs_vanilla_metadata": ours["manifest_bytes"] / vanilla["metadata_bytes"],
                "vanilla_repeat_vs_first_plan": cached["repeat_plan_s"] / cached["plan_s"],
                "gathered_vs_vanilla": ours["gathered_bytes"] / vanilla["gathered_bytes"],
            },
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---------------------------------------------------------------- output


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


COLUMNS = [
    ("layout", lambda r: f"{r['model']} {r['sharding']}"),
    ("N", lambda r: str(r["world"])),
    ("items", lambda r: str(r["ours"]["items"])),
    ("plan s (DCP)", lambda r: f"{r['ours']['plan_s']:.2f} ({r['vanilla']['plan_s']:.2f})"),
    ("commit s (DCP)", lambda r: f"{r['ours']['commit_s']:.2f} ({r['vanilla']['commit_s']:.2f})"),
    ("DCP cached repeat plan s", lambda r: f"{r['vanilla_cached']['repeat_plan_s']:.3f}"),
    (
        "gathered (DCP)",
        lambda r: (
            f"{_fmt_bytes(r['ours']['gathered_bytes'])} "
            f"({_fmt_bytes(r['vanilla']['gathered_bytes'])})"
        ),
    ),
    ("manifest", lambda r: _fmt_bytes(r["ours"]["manifest_bytes"])),
    (
        ".metadata (DCP)",
        lambda r: (
            f"{_fmt_bytes(r['ours']['metadata_bytes'])} "
            f"({_fmt_bytes(r['vanilla']['metadata_bytes'])})"
        ),
    ),
    ("md ratio", lambda r: f"{r['ratios']['metadata_bytes_vs_vanilla']:.2f}"),
    ("all node copies", lambda r: _fmt_bytes(r["ours"]["manifest_bytes_all_node_copies"])),
    ("parse s", lambda r: f"{r['ours']['reader_parse_s']:.2f}"),
    ("parse peak", lambda r: _fmt_bytes(r["ours"]["reader_peak_bytes"])),
    (
        "coord peak (DCP)",
        lambda r: (
            f"{_fmt_bytes(r['ours']['coordinator_peak_bytes'])} "
            f"({_fmt_bytes(r['vanilla']['coordinator_peak_bytes'])})"
        ),
    ),
    ("files", lambda r: str(r["ours"]["files_per_step"])),
    ("objects", lambda r: str(r["s3"]["none"]["objects_per_step"])),
    ("save req", lambda r: str(r["s3"]["none"]["save_requests_total"])),
    ("restore req", lambda r: str(r["s3"]["none"]["restore_requests_total"])),
    ("store ops", lambda r: str(r["ours"]["handshake"]["total_ops"])),
    ("store bytes", lambda r: _fmt_bytes(r["ours"]["handshake"]["total_bytes_through_store"])),
]


def table(rows: list[dict[str, Any]]) -> str:
    cells = [[name for name, _ in COLUMNS]] + [[f(r) for _, f in COLUMNS] for r in rows]
    lines = ["| " + " | ".join(row) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("---" for _ in COLUMNS) + "|")
    return "\n".join(lines)


def fit_exponent(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y over log x: y ~ x**slope."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


FITTED = {
    "ours.plan_s": lambda r: r["ours"]["plan_s"],
    "ours.commit_s": lambda r: r["ours"]["commit_s"],
    "vanilla.plan_s": lambda r: r["vanilla"]["plan_s"],
    "vanilla.commit_s": lambda r: r["vanilla"]["commit_s"],
    "ours.manifest_bytes": lambda r: r["ours"]["manifest_bytes"],
    "vanilla.metadata_bytes": lambda r: r["vanilla"]["metadata_bytes"],
    "ours.manifest_bytes_all_node_copies": lambda r: r["ours"]["manifest_bytes_all_node_copies"],
    "ours.gathered_bytes": lambda r: r["ours"]["gathered_bytes"],
    "ours.reader_parse_s": lambda r: r["ours"]["reader_parse_s"],
    "ours.reader_peak_bytes": lambda r: r["ours"]["reader_peak_bytes"],
    "ours.coordinator_peak_bytes": lambda r: r["ours"]["coordinator_peak_bytes"],
    "restore_metadata_bytes_all_ranks": lambda r: r["s3"]["none"][
        "restore_metadata_bytes_all_ranks"
    ],
    "handshake.total_bytes_through_store": lambda r: r["ours"]["handshake"][
        "total_bytes_through_store"
    ],
    "s3.save_LIST": lambda r: r["s3"]["none"]["save_requests"]["LIST"],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--ranks", default="16,64", help="comma-separated world sizes")
    ap.add_argument("--models", default="llama3-8b", help=f"comma-separated: {', '.join(MODELS)}")
    ap.add_argument("--shardings", default="fsdp2", help="fsdp2 and/or fsdp2+tp8")
    ap.add_argument("--thread-count", type=int, default=2, help="the writer's files per rank")
    ap.add_argument("--part-size-mib", type=int, default=16)
    ap.add_argument("--hash-prefixes", type=int, default=16, help="RemoteConfig.hash_prefixes")
    ap.add_argument(
        "--retained-steps",
        type=int,
        default=5,
        help="committed steps on the remote when a restore resolves 'latest'",
    )
    ap.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the tracemalloc passes (peak memory; they double the time)",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each side, alternating; the tables keep each time's least",
    )
    ap.add_argument("--dir", default=None, help="scratch directory (default: the system's)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    framing = _framing()
    rows = []
    started = time.perf_counter()
    for model in args.models.split(","):
        for sharding in args.shardings.split(","):
            for world in (int(x) for x in args.ranks.split(",")):
                if sharding == "fsdp2+tp8" and world % 8:
                    continue
                t0 = time.perf_counter()
                row = run_config(model, sharding, world, args, framing)
                row["harness_s"] = time.perf_counter() - t0
                rows.append(row)
                print(f"# {model} {sharding} N={world}: {row['harness_s']:.1f} s", flush=True)
                if args.json:  # as it goes: a long run's finished rows survive an interruption
                    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1, default=str))
    fits = {}
    for model in args.models.split(","):
        for sharding in args.shardings.split(","):
            sel = [r for r in rows if r["model"] == model and r["sharding"] == sharding]
            fits[f"{model} {sharding}"] = {
                k: fit_exponent([r["world"] for r in sel], [f(r) for r in sel])
                for k, f in FITTED.items()
            }
    print(table(rows))
    print("\nfitted exponents (y ~ N**k):")
    for layout_name, ks in fits.items():
        print(
            f"  {layout_name}: " + ", ".join(f"{k}={v:.2f}" for k, v in ks.items() if v is not None)
        )
    result = {
        "machine": {
            "cores": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "dcp_tiered": __version__,
        },
        "args": vars(args),
        "framing": framing,
        "rows": rows,
        "exponents": fits,
        "total_s": time.perf_counter() - started,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
