"""The memory tier's slots. The second slot made ahead: after a layout's first snapshot the
background thread makes the other slot, so the next snapshot finds its memory ready; a slot
file that exists (a committed snapshot of an earlier process or layout) is never made over; a
slot that cannot be made ahead is left to the save that needs it, which names the failure.
A write into a slot that fails (the copy, the commit, a partner's copy received) leaves that
slot to be written next: the newest snapshot is never the one the next write uncommits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dcp_tiered.errors import IntegrityError
from dcp_tiered.tiers import memory_slots
from dcp_tiered.tiers.memory import MemoryTier


def _state(seed: int, n: int = 6, width: int = 50_000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"t{i}": torch.randn(width + i, generator=g) for i in range(n)}}


def _restored(tier: MemoryTier, step: str, like: dict) -> dict:
    out = {"model": {k: torch.zeros_like(v) for k, v in like["model"].items()}}
    tier.load(step, out)
    return out


def _equal(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], v) for k, v in b["model"].items())


def test_the_second_snapshot_finds_its_slot_made_in_the_background(tmp_path, monkeypatch):
    tier = MemoryTier(tmp_path / "shm", 0)
    rank_dir = Path(tier.backend.root)
    try:
        first = _state(1)
        tier.save("step-1", first).result()
        tier._pool.submit(lambda: None).result()  # what was queued after the commit is done
        data, header = rank_dir / "slot-1.data", rank_dir / "slot-1.json"
        assert data.exists() and not header.exists()  # made, and not committed
        assert data.stat().st_size == (rank_dir / "slot-0.data").stat().st_size

        def no_new_memory(*args, **kwargs):
            raise AssertionError("the second snapshot made its slot again")

        monkeypatch.setattr(tier.backend, "map_file", no_new_memory)
        second = _state(2)
        tier.save("step-2", second).result()
        assert _equal(_restored(tier, "step-2", second), second)
        assert _equal(_restored(tier, "step-1", first), first)
    finally:
        tier.close()


def test_a_slot_file_that_exists_is_never_made_over(tmp_path):
    """An earlier process's two committed snapshots; a new process saves another layout into
    the older slot: the newer snapshot, in the other slot, keeps every byte and still
    restores (making the other slot ahead for the new layout would have cut its file)."""
    old = MemoryTier(tmp_path / "shm", 0)
    older, newer = _state(1), _state(2)
    try:
        old.save("step-1", older).result()
        old.save("step-2", newer).result()
    finally:
        old.close()
    rank_dir = tmp_path / "shm" / "rank-0"
    kept = {p.name: p.read_bytes() for p in rank_dir.glob("slot-1.*")}
    assert set(kept) == {"slot-1.data", "slot-1.json"}  # step-2, the newest

    new = MemoryTier(tmp_path / "shm", 0)
    other_layout = _state(3, n=3, width=70_000)
    try:
        new.save("step-3", other_layout).result()
    finally:
        new.close()  # waits for whatever the background thread was given
    assert {p.name: p.read_bytes() for p in rank_dir.glob("slot-1.*")} == kept
    again = MemoryTier(tmp_path / "shm", 0)
    try:
        assert _equal(_restored(again, "step-2", newer), newer)
        assert _equal(_restored(again, "step-3", other_layout), other_layout)
    finally:
        again.close()


def test_a_slot_that_cannot_be_made_ahead_is_left_to_the_next_save(tmp_path, monkeypatch):
    """No space for the other slot: the first snapshot is committed all the same, and the
    second save makes its slot itself (here: it can, once the space is back)."""
    calls = []
    real = memory_slots.LocalBackend.map_file

    def full_once(self, name, nbytes, **kwargs):
        calls.append(name)
        if len(calls) == 2:  # the slot made ahead
            raise OSError(28, "No space left on device")
        return real(self, name, nbytes, **kwargs)

    monkeypatch.setattr(memory_slots.LocalBackend, "map_file", full_once)
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        first, second = _state(1), _state(2)
        tier.save("step-1", first).result()
        tier.save("step-2", second).result()
        assert calls == ["slot-0.data", "slot-1.data", "slot-1.data"]
        assert _equal(_restored(tier, "step-1", first), first)
        assert _equal(_restored(tier, "step-2", second), second)
    finally:
        tier.close()


def test_a_header_without_its_data_is_not_made_a_slot_ahead(tmp_path):
    """A header left without its data file: no data file is made under it ahead (only the
    save that takes the slot removes the header and writes the slot)."""
    rank_dir = tmp_path / "shm" / "rank-0"
    rank_dir.mkdir(parents=True)
    (rank_dir / "slot-1.json").write_text("{}")
    assert memory_slots.reserve(memory_slots.LocalBackend(rank_dir), 1, 4096) is None
    assert not (rank_dir / "slot-1.data").exists()


def test_a_slot_made_meanwhile_by_another_process_is_left_alone(tmp_path, monkeypatch):
    """Between the look and the making, another process (an old one still running on this
    rank's directory) creates the slot's file: the reservation neither resizes nor removes it."""
    rank_dir = tmp_path / "shm" / "rank-0"
    rank_dir.mkdir(parents=True)
    theirs = rank_dir / "slot-1.data"
    theirs.write_bytes(b"not ours" * 100)
    backend = memory_slots.LocalBackend(rank_dir)
    monkeypatch.setattr(backend, "exists", lambda *names: False)  # the look saw nothing
    assert memory_slots.reserve(backend, 1, 1 << 20) is None
    assert theirs.read_bytes() == b"not ours" * 100


def test_a_slot_made_ahead_counts_as_made_for_the_room_check(tmp_path):
    """The manager asks the tier for room for two slots until both are made; the one made
    ahead has its memory already, so it counts (else a tmpfs with room for just the two
    refuses the second snapshot, and the slot made ahead is never used)."""
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        assert not tier.buffers_ready()
        tier.save("step-1", _state(1)).result()
        assert tier.buffers_ready()
    finally:
        tier.close()


def _fail(*args, **kwargs):
    raise OSError(5, "injected failure")


@pytest.mark.parametrize("where", ["copy", "commit"])
def test_a_write_that_fails_leaves_the_newest_snapshot_and_its_slot_is_written_next(
    tmp_path, monkeypatch, where
):
    tier = MemoryTier(tmp_path / "shm", 0)
    try:
        tier.save("step-1", _state(1)).result()
        tier.save("step-2", _state(2)).result()
        with monkeypatch.context() as m:
            if where == "copy":
                m.setattr(MemoryTier, "_copy_bytes", _fail)
                with pytest.raises(OSError, match="injected"):
                    tier.save("step-3", _state(3))
            else:  # the header's write, on the tier's thread: the future holds the error
                m.setattr(tier.backend, "replace_root_file", _fail)
                with pytest.raises(OSError, match="injected"):
                    tier.save("step-3", _state(3)).result()
        assert sorted(tier.steps()) == ["step-2"]
        tier.save("step-4", _state(4)).result()
        assert sorted(tier.steps()) == ["step-2", "step-4"]  # step 4 took the torn slot
        assert _equal(_restored(tier, "step-2", _state(2)), _state(2))
    finally:
        tier.close()


def test_a_partners_copy_that_fails_leaves_the_newest_copy_and_its_slot_is_written_next(
    tmp_path,
):
    """Peer replication: a copy received whose bytes fail their checksums is refused, and
    the next copy received goes to the slot it tore, not over the newest good copy."""
    sender = MemoryTier(tmp_path / "a", 0)
    keeper = MemoryTier(tmp_path / "b", 0, directory="replica-0")
    try:
        for n in (1, 2, 3, 4):
            sender.save(f"step-{n}", _state(n)).result()
            header, data = sender.lease(f"step-{n}")
            sender.release()
            flip = n == 3  # step 3 arrives with a byte flipped on the way

            def fill(buffer, data=data, flip=flip):
                buffer[: data.numel()].copy_(data)
                if flip:
                    buffer[7] ^= 0xFF

            if flip:
                with pytest.raises(IntegrityError):
                    keeper.receive(header, fill, step="step-3")
                assert sorted(keeper.steps()) == ["step-2"]
            else:
                keeper.receive(header, fill, step=f"step-{n}")
        assert sorted(keeper.steps()) == ["step-2", "step-4"]
        assert _equal(_restored(keeper, "step-2", _state(2)), _state(2))
    finally:
        sender.close()
        keeper.close()
