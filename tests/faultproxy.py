"""A fault-injecting HTTP reverse proxy for S3 tests (127.0.0.1 only, bounded, self-stopping).

Sits between s3fs and the S3 server and, for a seeded random share of requests, answers 500,
503 SlowDown, resets the connection before the response or in the middle of the body, or
stalls. The Host header is forwarded unchanged, so SigV4 signatures stay valid.

Usage: python tests/faultproxy.py --port P --upstream http://127.0.0.1:Q --rate 0.2 [--seed S]
       [--deny __1_]   (403 AccessDenied for every write of a key containing "__1_")
       [--corrupt .distcp --corrupt-count N]   (flip one byte in the body of the first N
                        writes of keys containing ".distcp": the store keeps corrupt data)
       [--fail-reads step-3/]   (503 SlowDown to every GET of a key containing "step-3/", a
                        store whose reads of it fail for a while, until POST /__heal__)
       [--slow-reads .distcp --slow-secs 2]   (every GET of such a key answers 2 s late)
       [--check-crc32c]   (a store that checks checksums, as AWS S3 does: a PUT whose body
                        fails its x-amz-checksum-crc32c header is refused with 400 BadDigest,
                        after any --corrupt flip, so a body corrupted on the way is refused)

GET /__faults__ answers what was injected, and how many PUT bodies (whole objects or parts)
came SHA-256-signed (``signed_bodies``) or with ``UNSIGNED-PAYLOAD`` (``unsigned_bodies``).
GET /__requests__ answers how many requests of each S3 kind reached the proxy (LIST, HEAD,
GET, PUT, CREATE/PART/COMPLETE/ABORT of multipart uploads, LIST_UPLOADS, DELETE, POST), and
how many of them named a key containing each ``?key=`` substring; POST /__requests__ resets.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import random
import sys

import crc32c
from aiohttp import ClientSession, ClientTimeout, web

FAULTS = ("500", "503", "reset-before", "reset-mid-body", "stall")
SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
BAD_DIGEST = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>BadDigest</Code>'
    b"<Message>The CRC32C you specified did not match the calculated checksum.</Message></Error>"
)
DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>Access Denied</Message></Error>"
)
INTERNAL = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error.</Message></Error>"
)
HOP = {"transfer-encoding", "connection", "keep-alive", "content-length", "content-encoding"}


def request_kind(method: str, query: dict, key: str) -> str:
    """The S3 operation a request is, from its method and query (path-style addressing)."""
    if method == "GET" and "uploads" in query:
        return "LIST_UPLOADS"
    if method == "GET" and ("list-type" in query or "prefix" in query or "delimiter" in query):
        return "LIST"
    if method == "POST" and "uploads" in query:
        return "CREATE"
    if method == "PUT" and "partNumber" in query:
        return "PART"
    if method == "POST" and "uploadId" in query:
        return "COMPLETE"
    if method == "DELETE" and "uploadId" in query:
        return "ABORT"
    if method == "GET" and "/" not in key:  # the bucket itself, without a listing query
        return "LIST"
    return method


def build_app(
    upstream: str,
    rate: float,
    seed: int,
    stall_secs: float,
    max_secs: float,
    deny: str | None = None,
    corrupt: str | None = None,
    corrupt_count: int = 0,
    fail_reads: str | None = None,
    slow_reads: str | None = None,
    slow_secs: float = 2.0,
    check_crc32c: bool = False,
) -> web.Application:
    rng = random.Random(seed)
    counts = {f: 0 for f in FAULTS} | {"ok": 0, "denied": 0, "corrupted": 0, "failed_reads": 0}
    counts["bad_digest"] = 0
    counts["signed_bodies"] = counts["unsigned_bodies"] = 0  # PUTs (and parts) by their SHA-256
    failing = {"reads": fail_reads}
    session: dict[str, ClientSession] = {}
    requests: list[tuple[str, str]] = []  # (kind, key) of every S3 request, in arrival order

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/__faults__":  # the test asks what was injected
            return web.json_response(counts)
        if request.path == "/__heal__":  # the store's reads work again
            failing["reads"] = None
            return web.json_response({})
        if request.path == "/__requests__":  # the test counts requests (POST: start again)
            if request.method == "POST":
                requests.clear()
                return web.json_response({})
            return web.json_response([list(r) for r in requests])
        key = request.path.lstrip("/").partition("/")[2]
        kind = request_kind(request.method, dict(request.query), key)
        requests.append((kind, request.query.get("prefix", key) if kind == "LIST" else key))
        body = await request.read()
        if failing["reads"] and failing["reads"] in key and kind == "GET":
            counts["failed_reads"] += 1
            return web.Response(status=503, body=SLOWDOWN, content_type="application/xml")
        if slow_reads and slow_reads in key and kind == "GET":
            await asyncio.sleep(slow_secs)
        if deny and deny in request.path and request.method in ("PUT", "POST"):
            counts["denied"] += 1  # a permanent failure for the writes of chosen keys
            return web.Response(status=403, body=DENIED, content_type="application/xml")
        if (
            corrupt
            and corrupt in request.path
            and request.method == "PUT"
            and len(body) > 64
            and counts["corrupted"] < corrupt_count
        ):
            counts["corrupted"] += 1  # the signature covers headers only: the store accepts it
            flipped = bytearray(body)
            flipped[len(body) // 2] ^= 0x01
            body = bytes(flipped)
        if request.method == "PUT" and body:
            unsigned = request.headers.get("x-amz-content-sha256") == "UNSIGNED-PAYLOAD"
            counts["unsigned_bodies" if unsigned else "signed_bodies"] += 1
        sent = request.headers.get("x-amz-checksum-crc32c")
        if check_crc32c and request.method == "PUT" and sent is not None:
            actual = base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode()
            if actual != sent:
                counts["bad_digest"] += 1
                return web.Response(status=400, body=BAD_DIGEST, content_type="application/xml")
        fault = rng.choice(FAULTS) if rng.random() < rate else None
        counts[fault or "ok"] += 1
        if fault == "500":
            return web.Response(status=500, body=INTERNAL, content_type="application/xml")
        if fault == "503":
            return web.Response(status=503, body=SLOWDOWN, content_type="application/xml")
        if fault == "reset-before":
            request.transport.close()
            return web.Response(status=500)  # never delivered
        if fault == "stall":
            await asyncio.sleep(stall_secs)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("content-length",)}
        async with session["s"].request(
            request.method,
            upstream + request.path_qs,
            headers=headers,
            data=body,
            allow_redirects=False,
        ) as up:
            data = await up.read()
            out = web.StreamResponse(
                status=up.status,
                headers={k: v for k, v in up.headers.items() if k.lower() not in HOP},
            )
            if request.method == "HEAD":  # no body, but the object's length must get through
                if "Content-Length" in up.headers:
                    out.headers["Content-Length"] = up.headers["Content-Length"]
                await out.prepare(request)
                await out.write_eof()
                return out
            out.content_length = len(data)
            await out.prepare(request)
            if fault == "reset-mid-body" and len(data) > 1:
                await out.write(data[: len(data) // 2])
                request.transport.close()
                return out
            await out.write(data)
            await out.write_eof()
            return out

    async def start(app: web.Application) -> None:
        session["s"] = ClientSession(timeout=ClientTimeout(total=120), auto_decompress=False)
        app["stopper"] = asyncio.get_running_loop().call_later(max_secs, sys.exit, 0)

    async def stop(app: web.Application) -> None:
        await session["s"].close()
        print("faults", counts, file=sys.stderr, flush=True)

    app = web.Application(client_max_size=2**31)
    app.router.add_route("*", "/{tail:.*}", handle)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--rate", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stall-secs", type=float, default=6.0)
    p.add_argument("--deny", help="answer 403 AccessDenied to writes of keys containing this")
    p.add_argument("--corrupt", help="flip a byte in PUT bodies of keys containing this")
    p.add_argument("--corrupt-count", type=int, default=1, help="how many PUTs to corrupt")
    p.add_argument("--fail-reads", help="503 to GETs of keys containing this, until healed")
    p.add_argument("--slow-reads", help="delay GETs of keys containing this by --slow-secs")
    p.add_argument("--slow-secs", type=float, default=2.0)
    p.add_argument("--check-crc32c", action="store_true", help="refuse bodies failing CRC32C")
    p.add_argument("--max-secs", type=float, default=1800.0, help="stop by itself after this")
    a = p.parse_args()
    app = build_app(
        a.upstream,
        a.rate,
        a.seed,
        a.stall_secs,
        a.max_secs,
        a.deny,
        a.corrupt,
        a.corrupt_count,
        a.fail_reads,
        a.slow_reads,
        a.slow_secs,
        a.check_crc32c,
    )
    web.run_app(app, host="127.0.0.1", port=a.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
