"""S3 figures of one state against s3torchconnector, in one process (one rank).

Per run: time to durable (ours: ``dcp.save`` to the local tier and ``wait_durable``, which
includes the local commit; s3torchconnector: ``dcp.save`` with ``S3StorageWriter``), then a
restore from S3 with nothing local (ours: ``TieredStorageReader`` on an empty root;
s3torchconnector: ``S3StorageReader``). Both into the same target, checked after each.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import s3fs
import torch
import torch.distributed.checkpoint as dcp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import states
from peers_lib import available, init_single_rank

from dcp_tiered import (
    RemoteConfig,
    TieredStorageReader,
    TieredStorageWriter,
    checkpoint_process_group,
)
from tests.s3server import s3fs_options

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", required=True, choices=sorted(states.NAMES))
    p.add_argument("--gib", type=float, default=None, help="large state only: its size")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    logging.getLogger("dcp_tiered").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    init_single_rank()
    if a.state == "large" and a.gib and not a.quick:
        state = states.large(max(1, int(a.gib * 32)), 32 * 2**20)
    else:
        state = states.build(a.state, a.quick)
    target = states.zeros_like(state)
    pg = checkpoint_process_group()
    work = Path(a.dir)
    opts = s3fs_options(a.endpoint, read_timeout=300)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    s3t = None
    if available()["s3torchconnector"]:
        from s3torchconnector import S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        os.environ.update(
            AWS_ENDPOINT_URL=a.endpoint,
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_REGION="us-east-1",
        )
        s3t = S3ClientConfig(force_path_style=True)
    samples: dict[str, list[float]] = {}

    def record(name: str, secs: float) -> None:
        samples.setdefault(name, []).append(secs)

    def blank() -> dict:
        for part in target.values():
            for t in part.values():
                t.zero_()
        return target

    def check(who: str) -> None:
        if not states.equal(target, state):
            raise AssertionError(f"{who} restored different bytes")

    tag = f"{a.state}-{states.nbytes(state) >> 20}m"
    for run in range(a.runs):
        prefix = f"{a.bucket}/{tag}-r{run}"
        cfg = RemoteConfig(url=f"s3://{prefix}/ours", storage_options=opts)
        writer = TieredStorageWriter(work / f"local-{run}", remote=cfg)
        t = time.perf_counter()
        dcp.save(state, checkpoint_id="step-1", storage_writer=writer, process_group=pg)
        writer.wait_durable("step-1")
        record("s3_ours_durable", time.perf_counter() - t)
        writer.close()
        if s3t is not None:
            url = f"s3://{prefix}/s3t"
            t = time.perf_counter()
            dcp.save(
                state,
                storage_writer=S3StorageWriter("us-east-1", url, s3client_config=s3t),
                process_group=pg,
            )
            record("s3_s3t_durable", time.perf_counter() - t)
        reader = TieredStorageReader(work / f"empty-{run}", remote=cfg)
        t = time.perf_counter()
        dcp.load(blank(), checkpoint_id="step-1", storage_reader=reader, process_group=pg)
        record("s3_ours_restore", time.perf_counter() - t)
        check("ours")
        if s3t is not None:
            reader = S3StorageReader("us-east-1", url, s3client_config=s3t)
            t = time.perf_counter()
            dcp.load(blank(), storage_reader=reader, process_group=pg)
            record("s3_s3t_restore", time.perf_counter() - t)
            check("s3torchconnector")
        shutil.rmtree(work / f"local-{run}", ignore_errors=True)
        shutil.rmtree(work / f"empty-{run}", ignore_errors=True)
        fs.rm(prefix, recursive=True)  # the server keeps objects: free them for the next run
    info = {"tensors": len(states.tensors(state)), "bytes": states.nbytes(state)}
    Path(a.out).write_text(json.dumps({**info, "samples": samples}))


if __name__ == "__main__":
    main()
