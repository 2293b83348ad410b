"""Listing and resolving steps read manifest heads, not whole indexes: a restore of one step of
a root with many decodes one index (its own), and a listing decodes none."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.policy import manifest
from dcp_tiered.tiers import local as local_tier
from dcp_tiered.tiers.local import LocalTier


def _state(v: float) -> dict:
    return {f"w{i}": torch.full((4,), v + i) for i in range(20)}


def _counting(monkeypatch) -> dict[str, int]:
    calls = {"parse": 0, "head": 0}
    parse, head = manifest.parse, manifest.parse_head

    def counted_parse(*a, **k):
        calls["parse"] += 1
        return parse(*a, **k)

    def counted_head(*a, **k):
        calls["head"] += 1
        return head(*a, **k)

    monkeypatch.setattr(manifest, "parse", counted_parse)
    monkeypatch.setattr(manifest, "parse_head", counted_head)
    return calls


def _saved(root, count: int, monkeypatch) -> None:
    """Steps step-0 .. step-<count-1> in ``root``, their heads cacheable although fresh."""
    monkeypatch.setattr(local_tier, "_SETTLED_NS", -(10**12))
    with TieredStorageWriter(root, sync_files=False) as writer:
        for k in range(count):
            dcp.save(_state(k), checkpoint_id=f"step-{k}", storage_writer=writer, no_dist=True)


def test_a_named_restore_reads_one_index_and_no_other_steps_manifest(tmp_path, monkeypatch):
    _saved(tmp_path, 6, monkeypatch)
    calls = _counting(monkeypatch)
    target = _state(-1.0)
    dcp.load(
        target, checkpoint_id="step-2", storage_reader=TieredStorageReader(tmp_path), no_dist=True
    )
    assert all(torch.equal(target[n], t) for n, t in _state(2).items())
    assert calls == {"parse": 1, "head": 1}, calls  # step-2's own, nothing of the other five

    calls.update(parse=0, head=0)
    target = _state(-1.0)
    dcp.load(
        target, checkpoint_id="latest", storage_reader=TieredStorageReader(tmp_path), no_dist=True
    )
    assert all(torch.equal(target[n], t) for n, t in _state(5).items())
    # 'latest' lists heads only, and step-2's is known already (same file version)
    assert calls["parse"] == 1 and calls["head"] == 5, calls


def test_a_listing_decodes_no_index(tmp_path, monkeypatch):
    _saved(tmp_path, 3, monkeypatch)
    calls = _counting(monkeypatch)
    tier = LocalTier(LocalBackend(tmp_path))
    listed = tier.steps()
    assert [s.name for s in sorted(listed, key=lambda s: s.committed_at_ns)] == [
        "step-0",
        "step-1",
        "step-2",
    ]
    assert all(s.verified_format and s.as_saved and s.committed_at_ns > 0 for s in listed)
    assert calls == {"parse": 0, "head": 3}, calls
    assert tier.steps() == listed and calls["head"] == 3  # listed again: a stat per step


def test_a_manifest_rewritten_in_place_is_read_again(tmp_path):
    """The head cache holds only files left alone for a while (their version then changes
    with any rewrite): a manifest tampered with in place right after it was read, in the same
    tick of the file clock, is read again, and so is the restored original."""
    with TieredStorageWriter(tmp_path, sync_files=False) as writer:
        dcp.save(_state(1), checkpoint_id="step-1", storage_writer=writer, no_dist=True)
    tier = LocalTier(LocalBackend(tmp_path))
    first = tier.info("step-1")
    assert first is not None and first.verified_format and first.committed_at_ns > 0
    path = tmp_path / "step-1" / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # in place: the seal no longer holds
    broken = tier.info("step-1")
    assert broken is not None and broken.committed_at_ns == -1  # unreadable, as listed before
    path.write_bytes(data)
    assert tier.info("step-1") == first


def test_a_head_is_read_without_decoding_the_index(tmp_path, monkeypatch):
    """A cold listing decodes each manifest's members before its tensors only: the index of
    a 20,000-tensor step was decoded once for the head and once more for the restore."""
    from dcp_tiered.policy import records

    _saved(tmp_path, 2, monkeypatch)
    decoded = []
    load_json = records.load_json
    monkeypatch.setattr(
        records, "load_json", lambda *a, **k: decoded.append(1) or load_json(*a, **k)
    )
    listed = LocalTier(LocalBackend(tmp_path)).steps()
    assert len(listed) == 2 and all(s.as_saved and s.committed_at_ns > 0 for s in listed)
    assert decoded == []


def test_a_head_member_repeated_after_the_index_is_refused(tmp_path, monkeypatch):
    """JSON keeps the last of a repeated member, the head read the first: a manifest whose
    head says one thing before its tensors and another after them (sealed again: the seal is
    no secret) is refused by the full parse, so the two can never disagree unseen."""
    from dcp_tiered.errors import ManifestError
    from dcp_tiered.policy import integrity, manifest_codec

    _saved(tmp_path, 1, monkeypatch)
    path = tmp_path / "step-0" / "manifest.json"
    data = path.read_bytes()
    raw = data[: -manifest_codec._SEAL_LEN] + b',"run_id":"' + b"f" * 32 + b'"}'
    crc = integrity.format_checksum(integrity.checksum(raw))
    forged = raw[:-1] + f',"manifest_checksum":"{crc}"}}'.encode()
    head = manifest.parse_head(forged, where="m")
    assert head.step == "step-0" and head.run_id != "f" * 32
    with pytest.raises(ManifestError, match="comes again with another value"):
        manifest.parse(forged, where="m")
    assert manifest.parse(data, where="m").step == "step-0"  # the original still parses


def test_a_head_member_placed_after_the_index_is_still_read(tmp_path, monkeypatch):
    """Another writer may put a head member after the tensors: the head read then decodes the
    whole index rather than miss it (a head without its run id would be another run's)."""
    from dcp_tiered.policy import integrity, manifest_codec

    _saved(tmp_path, 1, monkeypatch)
    data = (tmp_path / "step-0" / "manifest.json").read_bytes()
    run_id = manifest.parse_head(data, where="m").run_id
    assert run_id is not None
    member = f'"run_id":"{run_id}",'.encode()
    raw = data[: -manifest_codec._SEAL_LEN].replace(member, b"") + b"," + member[:-1] + b"}"
    crc = integrity.format_checksum(integrity.checksum(raw))
    moved = raw[:-1] + f',"manifest_checksum":"{crc}"}}'.encode()
    assert moved.index(b'"run_id"') > moved.index(b'"tensors"')
    assert manifest.parse_head(moved, where="m").run_id == run_id
    assert manifest.parse(moved, where="m").run_id == run_id
