"""One process that saves a step with a remote tier, then ends the way a job might.

    python tests/workers/job_end.py ROOT URL OPTIONS_JSON (--close SECS | --no-close)

Prints CLOSE-RAISED <type>: <message> if close() raised, then MAIN-DONE, and exits normally
(interpreter teardown included: that is what is under test).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root")
    p.add_argument("url")
    p.add_argument("options")
    p.add_argument("--close", type=float)
    p.add_argument("--no-close", action="store_true")
    a = p.parse_args()
    writer = TieredStorageWriter(a.root, remote=a.url, storage_options=json.loads(a.options))
    dcp.save(
        {"w": torch.arange(1000.0)}, checkpoint_id="step-1", storage_writer=writer, no_dist=True
    )
    if not a.no_close:
        started = time.monotonic()
        try:
            writer.close(timeout_secs=a.close)
        except Exception as e:  # noqa: BLE001 - reported for the test
            print(f"CLOSE-RAISED {type(e).__name__}: {e}", flush=True)
        print(f"CLOSE-SECS {time.monotonic() - started:.2f}", flush=True)
    print("MAIN-DONE", flush=True)


if __name__ == "__main__":
    main()
