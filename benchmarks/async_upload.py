"""Threads (today's uploads) vs an asyncio pipeline (aiofiles + s3fs's async multipart API).

Uploads the same files to the moto S3 server both ways, interleaved (A B A B ...), and prints
each way's median and the ratio. "threads" is what the remote tier does: one thread per file
(up to ``max_concurrency``), each calling ``RemoteBackend.put_file`` (s3fs's multipart upload,
``max_concurrency`` parts at once). "asyncio" reads each part with aiofiles and sends it with
``upload_part`` on one event loop, ``max_concurrency`` files and parts at once. aiofiles is no
longer a dependency (this measurement is why: see CHANGELOG); without it the parts are read
with ``asyncio.to_thread(os.pread)``, which is what aiofiles does underneath (a thread pool).

    .venv/bin/python benchmarks/async_upload.py [--mib 256] [--files 8] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import s3fs

try:
    import aiofiles
except ImportError:  # not a dependency any more
    aiofiles = None

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dcp_tiered import RemoteConfig
from dcp_tiered.backends.remote import RemoteBackend
from tests.s3server import s3fs_options, start_moto

BUCKET = "bench"


def upload_threads(files: list[Path], prefix: str, opts: dict, part: int, conc: int) -> None:
    backend = RemoteBackend(
        RemoteConfig(
            url=f"s3://{BUCKET}/{prefix}",
            storage_options=opts,
            part_size_bytes=part,
            max_concurrency=conc,
        )
    )
    with ThreadPoolExecutor(conc) as pool:
        for f in [pool.submit(backend.put_file, str(p), p.name, "0") for p in files]:
            f.result()


async def read_part(path: Path, offset: int, part: int) -> bytes:
    if aiofiles is not None:
        async with aiofiles.open(path, "rb") as f:  # a handle per part in flight
            await f.seek(offset)
            return await f.read(part)
    fd = os.open(path, os.O_RDONLY)
    try:
        return await asyncio.to_thread(os.pread, fd, part, offset)
    finally:
        os.close(fd)


async def _upload_async(files: list[Path], prefix: str, opts: dict, part: int, conc: int) -> None:
    fs = s3fs.S3FileSystem(asynchronous=True, **opts)
    session = await fs.set_session()
    file_slots = asyncio.Semaphore(conc)  # as the remote tier: conc files, conc parts each

    async def one_part(path: Path, key: str, uid: str, n: int, slots: asyncio.Semaphore) -> dict:
        async with slots:
            data = await read_part(path, (n - 1) * part, part)
            out = await fs._call_s3(
                "upload_part", Bucket=BUCKET, Key=key, UploadId=uid, PartNumber=n, Body=data
            )
            return {"PartNumber": n, "ETag": out["ETag"]}

    async def one_file(path: Path) -> None:
        key = f"{prefix}/{path.name}"
        size = path.stat().st_size
        async with file_slots:
            mpu = await fs._call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
            uid = mpu["UploadId"]
            count = max(1, -(-size // part))
            slots = asyncio.Semaphore(conc)
            parts = await asyncio.gather(
                *(one_part(path, key, uid, n, slots) for n in range(1, count + 1))
            )
            await fs._call_s3(
                "complete_multipart_upload",
                Bucket=BUCKET,
                Key=key,
                UploadId=uid,
                MultipartUpload={"Parts": list(parts)},
            )

    try:
        await asyncio.gather(*(one_file(p) for p in files))
    finally:
        await session.close()


def upload_asyncio(files: list[Path], prefix: str, opts: dict, part: int, conc: int) -> None:
    asyncio.run(_upload_async(files, prefix, opts, part, conc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="total bytes uploaded per run")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--part-mib", type=int, default=RemoteConfig.part_size_bytes // 2**20)
    ap.add_argument("--concurrency", type=int, default=RemoteConfig.max_concurrency)
    args = ap.parse_args()
    part, conc = args.part_mib * 2**20, args.concurrency
    moto, endpoint = start_moto()
    try:
        opts = s3fs_options(endpoint, read_timeout=120)
        check = s3fs.S3FileSystem(**opts)
        check.call_s3("create_bucket", Bucket=BUCKET)
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for i in range(args.files):
                p = Path(tmp) / f"__{i}_0.distcp"
                p.write_bytes(os.urandom(args.mib * 2**20 // args.files))
                files.append(p)
            ways = {"threads": upload_threads, "asyncio": upload_asyncio}
            times: dict[str, list[float]] = {w: [] for w in ways}
            for run in range(args.runs):
                for way, upload in ways.items():
                    prefix = f"{way}-{run}"
                    t0 = time.perf_counter()
                    upload(files, prefix, opts, part, conc)
                    times[way].append(time.perf_counter() - t0)
                    got = check.du(f"{BUCKET}/{prefix}", total=False)
                    want = {f"{BUCKET}/{prefix}/{p.name}": p.stat().st_size for p in files}
                    assert got == want, (way, got, want)  # every byte arrived, both ways
                    check.rm(f"{BUCKET}/{prefix}", recursive=True)
                    check.invalidate_cache()
        mib = args.mib
        for way, ts in times.items():
            med = statistics.median(ts)
            print(
                f"{way:8s} median {med:6.2f} s  ({mib / med:5.1f} MiB/s)  runs "
                + " ".join(f"{t:.2f}" for t in ts)
            )
        ratio = statistics.median(times["asyncio"]) / statistics.median(times["threads"])
        print(
            f"asyncio / threads = {ratio:.2f}  ({mib} MiB in {args.files} files, "
            f"{args.part_mib} MiB parts, {conc} at once, {args.runs} runs; asyncio read parts "
            f"with {'aiofiles' if aiofiles else 'asyncio.to_thread'})"
        )
    finally:
        moto.terminate()
        moto.wait()


if __name__ == "__main__":
    main()
