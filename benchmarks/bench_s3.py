"""Remote-tier benchmark against a real S3 server (moto on 127.0.0.1 unless --endpoint).

Figures, all on the same state and server in one run, as ratios against baselines:
time-to-durable vs an s3fs bulk put of the same files and vs torch's FsspecWriter dcp.save;
restore from S3 alone vs FsspecReader dcp.load. Usage:
``.venv/bin/python benchmarks/bench_s3.py --gib 0.25 --runs 3``.
Note: moto reads a whole object for every ranged GET, which penalises ranged restores; use a
production-like server (Ceph RGW, LocalStack) for absolute restore figures.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path

import s3fs
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dcp_tiered import RemoteConfig, TieredStorageReader, TieredStorageWriter  # noqa: E402
from tests.s3server import s3fs_options, start_moto  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gib", type=float, default=0.25)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--endpoint", help="an S3 endpoint (default: start moto)")
    p.add_argument("--part-mib", type=int, default=16, help="multipart part size")
    p.add_argument("--thread-count", type=int, default=2, help="files per rank")
    p.add_argument("--out", default="benchmarks/results/s3.json")
    a = p.parse_args()
    torch.set_num_threads(1)
    proc = None
    if a.endpoint:
        endpoint = a.endpoint
    else:
        proc, endpoint = start_moto()
    opts = s3fs_options(endpoint, read_timeout=120)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    n = max(1, int(a.gib * 1024 / 32))
    state = {f"t{i:03d}": torch.randn(32 * 2**18) for i in range(n)}
    nbytes = n * 32 * 2**20
    work = Path(tempfile.mkdtemp(prefix="dcp-tiered-s3bench-"))
    samples: dict[str, list[float]] = {k: [] for k in (
        "ours_durable", "s3fs_put", "fsspec_save", "ours_restore", "fsspec_restore")}
    try:
        for run in range(a.runs):
            prefix = f"{bucket}/r{run}"
            cfg = RemoteConfig(url=f"s3://{prefix}/ours", storage_options=opts,
                               part_size_bytes=a.part_mib * 2**20)
            writer = TieredStorageWriter(work / f"local{run}", remote=cfg,
                                         thread_count=a.thread_count)
            t = time.perf_counter()
            dcp.save(state, checkpoint_id="step-1", storage_writer=writer, no_dist=True)
            writer.wait_durable("step-1")
            samples["ours_durable"].append(time.perf_counter() - t)

            t = time.perf_counter()
            fs.put(str(work / f"local{run}" / "step-1"), f"{prefix}/bulk", recursive=True)
            samples["s3fs_put"].append(time.perf_counter() - t)

            t = time.perf_counter()
            dcp.save(state, no_dist=True, storage_writer=FsspecWriter(
                f"s3://{prefix}/fsspec", sync_files=False, **opts))
            samples["fsspec_save"].append(time.perf_counter() - t)

            target = {k: torch.empty_like(v) for k, v in state.items()}
            t = time.perf_counter()
            dcp.load(target, no_dist=True, storage_reader=TieredStorageReader(
                work / f"empty{run}", remote=cfg))
            samples["ours_restore"].append(time.perf_counter() - t)
            assert all(torch.equal(target[k], state[k]) for k in state)

            t = time.perf_counter()
            dcp.load(target, no_dist=True, storage_reader=FsspecReader(
                f"s3://{prefix}/fsspec", **opts))
            samples["fsspec_restore"].append(time.perf_counter() - t)
            shutil.rmtree(work / f"local{run}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if proc is not None:
            proc.terminate()
    med = {k: statistics.median(v) for k, v in samples.items()}
    ratios = {
        "durable_vs_s3fs_put": (med["ours_durable"] / med["s3fs_put"], 1.1),
        "durable_vs_fsspec_save": (med["ours_durable"] / med["fsspec_save"], 0.5),
        "restore_vs_fsspec_load": (med["ours_restore"] / med["fsspec_restore"], 0.5),
    }
    print(f"state {nbytes / 2**30:.2f} GiB, {a.runs} runs, server {endpoint}")
    for k, v in samples.items():
        print(f"  {k:<15} median {statistics.median(v):7.2f}s  min {min(v):7.2f}  max {max(v):7.2f}")
    for k, (v, target) in ratios.items():
        print(f"  {k:<24} {v:6.3f}  (target <= {target})  {'met' if v <= target else 'NOT met'}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"bytes": nbytes, "samples": samples,
                                       "ratios": {k: v[0] for k, v in ratios.items()}}, indent=1))


if __name__ == "__main__":
    main()
