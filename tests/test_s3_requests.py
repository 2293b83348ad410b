"""The S3 request budget (docs/scale.md items 4, 5, 6, 8), counted on the wire.

Against a real S3 server (moto on 127.0.0.1) behind tests/faultproxy.py with no faults
injected: the proxy records every request's kind (LIST, HEAD, GET, PUT, multipart CREATE /
PART / COMPLETE) and key or listed prefix."""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time

import s3fs

from dcp_tiered import RemoteConfig
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.policy import identity, layout
from dcp_tiered.policy.prefixes import PrefixStrategy
from dcp_tiered.tiers import uploads
from dcp_tiered.tiers.file_upload import upload_verified
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.promotion import Promotion
from dcp_tiered.tiers.remote import RemoteTier
from tests.conftest import proxied_requests
from tests.test_remote_tier import FAST_RETRY, equal, load, save, state


def config(s3, endpoint=None, url=None, **kw) -> RemoteConfig:
    kw.setdefault("part_size_bytes", 5 * 2**20)
    return RemoteConfig(
        url=url or s3.url(), storage_options=s3.options(endpoint), retry=FAST_RETRY, **kw
    )


def kinds(reqs) -> dict[str, int]:
    return dict(collections.Counter(kind for kind, _ in reqs))


def save_steps(tmp_path, cfg, steps, mib=1.0, **kw):
    for i, step in enumerate(steps, 1):
        writer = save(tmp_path / "local", cfg, step, state(i, mib=mib), **kw)
        writer.wait_durable(step, timeout_secs=120)
        writer.close()


def test_restoring_latest_lists_nothing_but_the_start_up_probe(tmp_path, s3, fault_proxy):
    """'latest' comes from the root's pointer (one GET) and its step's marker, whatever the
    number of steps: no listing of the root nor of each step (the per-rank LIST storm)."""
    proxy = fault_proxy(0.0)
    cfg = config(s3, proxy)
    save_steps(tmp_path, cfg, ["step-1", "step-2", "step-10"])
    proxied_requests(proxy, reset=True)
    got, reader = load(tmp_path / "fresh", cfg)
    assert reader.checkpoint_id == "step-10" and equal(got, state(3))
    reqs = proxied_requests(proxy)
    lists = [key for kind, key in reqs if kind == "LIST"]
    assert len(lists) == 1, lists  # the reader's one-key start-up probe, nothing else
    gets = [key for kind, key in reqs if kind == "GET"]
    assert sum(k.endswith(layout.REMOTE_LATEST) for k in gets) == 1
    assert not any("step-1/" in k or "step-2/" in k for k in gets), gets
    # the step's marker: once to resolve 'latest', once for the keys of its manifest and data
    assert sum(k.endswith(f"step-10/{layout.REMOTE_MARKER}") for k in gets) == 2, gets


def test_a_root_without_pointer_or_with_a_stale_one_still_restores_the_newest(
    tmp_path, s3, fault_proxy
):
    proxy = fault_proxy(0.0)
    cfg = config(s3, proxy)
    save_steps(tmp_path, cfg, ["step-1", "step-2"])
    backend = RemoteBackend(config(s3, url=cfg.url))
    # Stale: the pointer's step is quarantined (its marker moved aside): step-1 is latest.
    run_id = RemoteTier(backend).marker("step-2")["run_id"]
    RemoteTier(backend).quarantine("step-2", reason="test", run_id=run_id)
    got, reader = load(tmp_path / "fresh1", cfg)
    assert reader.checkpoint_id == "step-1" and equal(got, state(1))
    # Missing, as in a root written before the pointer existed: listed once, still found.
    backend.remove(layout.REMOTE_LATEST, reason="test: a root of an older version")
    proxied_requests(proxy, reset=True)
    got, reader = load(tmp_path / "fresh2", cfg)
    assert reader.checkpoint_id == "step-1" and equal(got, state(1))
    assert kinds(proxied_requests(proxy))["LIST"] > 1  # the fallback listing
    # A step name is one marker GET, no listing, and a step that is not there says so.
    proxied_requests(proxy, reset=True)
    got, reader = load(tmp_path / "fresh3", cfg, step="step-1")
    assert equal(got, state(1))
    assert kinds(proxied_requests(proxy))["LIST"] == 1


def test_the_latest_pointer_only_moves_forward_when_saves_race(s3):
    cfg = config(s3)
    backend = RemoteBackend(cfg)
    steps = [f"step-{n}" for n in (3, 11, 7, 20, 2, 19, 5, 13)]
    markers = {}
    for i, step in enumerate(steps):
        markers[step] = layout.marker_body(step, f"{i + 1:x}" * 4, time.time_ns(), PrefixStrategy())
        backend.put_bytes(f"{step}/{layout.REMOTE_MARKER}", json.dumps(markers[step]).encode())
    barrier = threading.Barrier(len(steps))

    def commit(step: str) -> None:
        barrier.wait()
        RemoteTier(backend).advance_latest(step, markers[step])

    threads = [threading.Thread(target=commit, args=(s,)) for s in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    body, _ = RemoteTier(backend).read_latest()
    assert body["step"] == "step-20" and body["marker"] == markers["step-20"]
    RemoteTier(backend).advance_latest("step-4", markers["step-5"] | {"step": "step-4"})
    assert RemoteTier(backend).read_latest()[0]["step"] == "step-20"  # never backwards


def test_a_save_never_lists_its_own_objects(tmp_path, s3, fault_proxy):
    """Promotion checks (or trusts this process's early upload's record of) only its own
    files; the coordinator's commit lists the node records, and the save once, as the store's
    proof that every object is there before the marker (a page per 1,000 objects);
    read-back is one GET per object, with no HEAD before it."""
    proxy = fault_proxy(0.0)
    cfg = config(s3, proxy)
    mib = 24  # a 24 MiB file: 5 multipart parts, which a ranged read-back took 2 GETs for
    writer = save(tmp_path / "local", cfg, "step-1", state(1, mib=mib))
    writer.wait_durable("step-1", timeout_secs=120)
    writer.close()
    reqs = proxied_requests(proxy)
    sid = LocalTier(LocalBackend(str(tmp_path / "local"))).read_manifest("step-1").save_id
    listed = [key for kind, key in reqs if kind == "LIST"]
    of_save = [k for k in listed if f"step-1/{sid}" in k and "/_nodes" not in k]
    assert of_save == [f"{cfg.url.split('/', 3)[3]}/step-1/{sid}/"], listed
    data = collections.defaultdict(collections.Counter)
    for kind, key in reqs:
        if key.endswith(".distcp"):
            data[key.rpartition("/")[2]][kind] += 1
    for name, count in data.items():
        # Each file once: an early upload and the promotion never both send it. Minimum per
        # upload: its PUT, or CREATE + parts + COMPLETE.
        uploads = count["PUT"] + count["COMPLETE"]
        assert uploads == 1, (name, count)
        extra = sum(count.values()) - count["PUT"] - count["CREATE"] - count["PART"]
        extra -= count["COMPLETE"]
        # The read-back GET and no HEAD; plus, when the promotion uploads it (the early
        # upload had not yet), the promotion's GET that finds it not there yet.
        assert count["HEAD"] == 0 and uploads <= extra <= uploads + 1, (name, count)
        if count["PART"]:
            assert count["PART"] == uploads * 5, (name, count)  # 24 MiB in 5 MiB parts
    got, _ = load(tmp_path / "fresh", cfg, mib=mib)
    assert equal(got, state(1, mib=mib))


def test_the_coordinator_polls_node_records_with_one_listing_per_round(tmp_path, s3, fault_proxy):
    proxy = fault_proxy(0.0)
    cfg = config(s3, proxy)
    root = tmp_path / "local"
    save(root, None, "step-1", state(1)).close()  # committed locally only
    tier = LocalTier(LocalBackend(str(root)))
    m = tier.read_manifest("step-1")
    m = dataclasses.replace(m, nodes=[*m.nodes, [97], [98], [99]])  # three other nodes
    backend = RemoteBackend(cfg)
    promotion = Promotion(tier, backend, "step-1", None)  # type: ignore[arg-type]
    keys = RemoteTier(backend).keys("step-1", m.save_id)
    tags = {  # node 0 uploads its own files first, as its promotion does
        name: upload_verified(tier, backend, ("step-1",), name, keys.file(name), info["checksum"])
        for name, info in m.files.items()
    }
    for node in (1, 2):
        backend.put_bytes(keys.node_record(node), json.dumps({"save_id": m.save_id}).encode())
    late = threading.Timer(
        1.0,
        lambda: backend.put_bytes(keys.node_record(3), json.dumps({"save_id": m.save_id}).encode()),
    )
    proxied_requests(proxy, reset=True)
    late.start()
    promotion._commit(m, keys, tier.record().run_id, tags)
    late.join()
    reqs = proxied_requests(proxy)
    polls = [k for kind, k in reqs if kind == "LIST" and k.endswith("/_nodes/")]
    assert len(polls) >= 2  # a few rounds while node 3 was late
    # Once every node is in, each node's record is read once: the tags its objects had when
    # that node verified them, which the commit's listing must show.
    reads = [k for kind, k in reqs if kind in ("GET", "HEAD") and "/_nodes/" in k]
    prefix = cfg.url.split("/", 3)[3]
    assert sorted(reads) == sorted(f"{prefix}/{keys.node_record(n)}" for n in (1, 2, 3))
    assert RemoteTier(backend).marker("step-1")["save_id"] == m.save_id


def test_hash_prefixes_are_configurable_and_recorded_for_readers(tmp_path, s3):
    cfg = config(s3, prefix_strategy="hash", hash_prefixes=64)
    writer = save(tmp_path / "local", cfg, "step-1", state(1), thread_count=8)
    writer.wait_durable("step-1", timeout_secs=120)
    writer.close()
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    base = cfg.url.removeprefix("s3://")
    buckets = {k[len(base) + 1 :].split("/")[1] for k in fs.find(f"{base}/data")}
    expected = {
        f"{zlib_bucket(f'step-1/{n}', 64):x}" for n in [f"__0_{i}.distcp" for i in range(8)]
    }
    assert buckets and buckets <= expected and any(int(b, 16) >= 16 for b in expected)
    marker = json.loads(fs.cat_file(f"{base}/step-1/{layout.REMOTE_MARKER}"))
    assert marker["hash_prefixes"] == 64
    # A reader configured otherwise reads the count from the marker.
    other = config(s3, url=cfg.url, prefix_strategy="hash", hash_prefixes=16)
    got, reader = load(tmp_path / "fresh", other)
    assert equal(got, state(1)) and reader.files_read_remotely
    # Orphans of a killed save of the run are found in every bucket its claim records,
    # whatever the count now; objects no claim of the run names are not its to remove.
    claim = {"format": "dcp-tiered-claim", "run_id": marker["run_id"], "step": "step-1"}
    claim |= {"save_id": "abcdef", "prefix_strategy": "hash", "hash_prefixes": 64}
    orphans = ["data/2f/step-1/abcdef/__0_0.distcp", "step-1/abcdef/_nodes/node-0.json"]
    for key in orphans:
        fs.pipe_file(f"{base}/{key}", b"x")
    fs.pipe_file(f"{base}/step-1/abcdef/_claims/node-0.json", json.dumps(claim).encode())
    foreign = ["data/2f/step-1/abcdee/__0_0.distcp", "step-1/abcdee/_nodes/node-0.json"]
    for key in foreign:
        fs.pipe_file(f"{base}/{key}", b"x")
    RemoteTier(RemoteBackend(other)).remove_orphan_saves("step-1", marker["run_id"], keep=set())
    left = {k[len(base) + 1 :] for k in fs.find(base)}
    assert not left & set(orphans) and set(foreign) <= left
    got, _ = load(tmp_path / "fresh2", other)
    assert equal(got, state(1))


def zlib_bucket(name: str, n: int) -> int:
    import zlib

    return zlib.crc32(name.encode()) % n


def test_the_ranks_of_a_node_read_the_remote_marker_once_per_save(tmp_path, s3, fault_proxy):
    """Early uploads never write under a step committed on the remote, which the marker says.
    The ranks of a node share the answer through their upload area: one GET per node and
    save, not one per rank (the uploader is per process, as the ranks are)."""
    proxy = fault_proxy(0.0)
    url = s3.url()
    remote = RemoteBackend(config(s3, proxy, url=url))
    tier = LocalTier(LocalBackend(str(tmp_path / "local")))
    area = layout.upload_area_name("step-1", "sid1")
    tier.backend.make_dir(area)
    ranks = [uploads.Uploader(tier, remote) for _ in range(4)]
    answers = []
    keys1 = layout.RemoteKeys("step-1", "a1")
    threads = [
        threading.Thread(
            target=lambda u=u: answers.append(u._remote_step_free(keys1, area, 0, "run-a"))
        )
        for u in ranks
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [True] * 4
    gets = [k for kind, k in proxied_requests(proxy) if kind == "GET"]
    marker_gets = [k for k in gets if k.endswith(layout.REMOTE_MARKER)]
    assert len(marker_gets) == 1, gets
    assert len([k for k in gets if k.endswith(identity.RUN_RECORD)]) == 1, gets  # the run's
    # A step taken on the remote is recorded as such for the node's other ranks too.
    save_steps(tmp_path / "other", config(s3, url=url), ["step-2"], run_id="run-a")
    tier.backend.make_dir(area2 := layout.upload_area_name("step-2", "a2"))
    keys2 = layout.RemoteKeys("step-2", "a2")
    assert [u._remote_step_free(keys2, area2, 0, "run-a") for u in ranks] == [False] * 4
    assert (
        sum(k.endswith(f"step-2/{layout.REMOTE_MARKER}") for _, k in proxied_requests(proxy)) == 1
    )
