"""Start a CheckpointManager whose remote options differ per rank; record what each raised."""

from __future__ import annotations

import argparse
import json

import common
import torch.distributed as dist

from dcp_tiered import CheckpointManager, RemoteConfig


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--disk", required=True)
    p.add_argument("--options", required=True)  # {rank: storage_options}
    p.add_argument("--out", required=True)
    a = p.parse_args()
    rank, _ = common.init()
    remote = RemoteConfig(url=a.url, storage_options=json.loads(a.options)[str(rank)])
    result = {"error": None, "msg": ""}
    try:
        CheckpointManager(local=f"{a.disk}-{rank}", remote=remote, events=None).close()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        result = {"error": type(e).__name__, "msg": str(e)}
    dist.barrier()  # every rank got here: nobody was left waiting
    common.write_json(f"{a.out}.{rank}", result)
    common.finish()


if __name__ == "__main__":
    main()
