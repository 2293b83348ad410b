"""CheckpointManager in one process: cadence, admission control, restore fallback, events,
retention on real directories and ``dcp-tiered status``. Multi-rank behaviour (SIGKILL and
resume, memory-tier recovery, failure propagation) is in test_manager_resume.py."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import warnings

import pytest
import torch

from dcp_tiered import (
    Admission,
    CheckpointManager,
    CheckpointNotFoundError,
    ConfigError,
    Every,
    InsufficientSpaceError,
    RankState,
    Retention,
    RetentionPolicy,
    SaveFailedError,
    SavePolicy,
    rank_state,
)
from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.cli import main as cli
from dcp_tiered.policy import layout
from dcp_tiered.policy.admission import Headroom, shortfall
from dcp_tiered.policy.cadence import Decision, agree, decide
from dcp_tiered.tiers import memory_slots
from tests.conftest import Gate

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
MIB = 2**20


def _steps(root) -> list[str]:
    names = [n for n in os.listdir(root) if n.startswith("step-")]
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def _in_memory(root) -> list[str]:
    """Steps every rank's slots hold in a memory tier."""
    return sorted(memory_slots.list_steps(root), key=lambda n: int(n.split("-")[1]))


def _hidden_dirs(root) -> list[str]:
    return [n for n in os.listdir(root) if n.startswith(".") and os.path.isdir(root / n)]


def _state(mib: float = 0.25, value: float = 0.0) -> dict:
    return {"w": torch.full((int(mib * 2**18),), float(value))}


def _events(root) -> list[dict]:
    return [
        json.loads(line) for line in (root / ".dcp-tiered-events.jsonl").read_text().splitlines()
    ]


# ---------------------------------------------------------------- cadence (pure)


def test_cadence_by_steps_sends_each_step_to_one_tier():
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=5), remote=Every(steps=10))
    got = [decide(policy, s, 0.0, {}) for s in range(11)]
    assert [d.local for d in got] == [s % 5 == 0 for s in range(11)]
    assert [d.remote for d in got] == [s % 10 == 0 for s in range(11)]
    assert all(d.memory != d.local for d in got)  # disk steps are not written twice


def test_cadence_by_seconds_and_force():
    policy = SavePolicy(memory=None, local=Every(secs=60), remote=None)
    assert not decide(policy, 7, now=100.0, last={"local": 50.0}).any
    assert decide(policy, 7, now=111.0, last={"local": 50.0}).local
    forced = decide(policy, 7, now=100.0, last={"local": 99.0}, force=True)
    assert forced.local and forced.remote
    assert not decide(policy, 7, 0, {}, force=True, has_remote=False).remote


def test_ranks_agree_on_the_union_of_what_any_rank_found_due():
    # rank A's clock says memory, rank B's says local: everyone saves to local, once.
    assert agree([1, 1, 0]) == Decision(memory=False, local=True, remote=False)
    assert agree([0, 0, 1]) == Decision(memory=False, local=True, remote=True)


def test_every_needs_a_period():
    with pytest.raises(ValueError, match="steps= or secs="):
        Every()


# ---------------------------------------------------------------- admission (pure)


def test_shortfall_names_the_tier_and_the_numbers():
    adm = Admission(memory_margin_bytes=0, disk_margin_bytes=10 * MIB)
    h = Headroom(
        ranks_on_node=2,
        new_tier_bytes=40 * MIB,
        new_ram_bytes=0,
        ram_available=None,
        tier_free=85 * MIB,
    )
    why = shortfall(adm, h, "local")
    assert why is not None and "85 MiB free" in why and "80 MiB" in why and "10 MiB" in why
    assert shortfall(adm, Headroom(2, 40 * MIB, 0, None, 95 * MIB), "local") is None
    # Slots already allocated: nothing new to find room for, however full the tmpfs is.
    assert shortfall(adm, Headroom(2, 0, 0, 0, 0), "memory") is None
    h = Headroom(
        1, new_tier_bytes=80 * MIB, new_ram_bytes=80 * MIB, ram_available=70 * MIB, tier_free=10**12
    )
    assert "host RAM" in (shortfall(adm, h, "memory") or "")


# ---------------------------------------------------------------- the manager, for real


@pytest.fixture
def tiers(tmp_path):
    return {
        "memory": tmp_path / "shm",
        "local": tmp_path / "disk",
        "remote": f"file://{tmp_path / 'remote'}",
    }


def test_saves_follow_the_cadence_and_retention_per_tier(tmp_path, tiers):
    mgr = CheckpointManager(
        **tiers,
        writer_options={"sync_files": False},
        policy=SavePolicy(memory=Every(steps=1), local=Every(steps=3), remote=Every(steps=6)),
        retention=Retention(
            local=RetentionPolicy(keep_latest=1, keep_every=6),
            remote=RetentionPolicy(keep_latest=1, pinned={"step-0"}),
        ),
    )
    for step in range(14):
        mgr.save(step, _state(value=step))
    mgr.close()
    assert _in_memory(tiers["memory"]) == ["step-11", "step-13"]  # its two slots
    assert sorted(os.listdir(tiers["memory"] / "rank-0")) == [
        "slot-0.data",
        "slot-0.json",
        "slot-1.data",
        "slot-1.json",
    ]  # reused, never more
    assert _steps(tiers["local"]) == ["step-0", "step-6", "step-12"]  # milestones + newest
    assert _steps(tmp_path / "remote") == ["step-0", "step-12"]  # pinned + newest
    assert not _hidden_dirs(tiers["local"])


@pytest.mark.parametrize("bad", [True, -1, 1.0, "3"])
def test_a_step_that_is_not_a_non_negative_int_is_refused(tmp_path, tiers, bad):
    from dcp_tiered import ConfigError

    with CheckpointManager(**tiers) as mgr, pytest.raises(ConfigError, match="non-negative int"):
        mgr.save(bad, _state())
    assert not tiers["local"].exists() or _steps(tiers["local"]) == []


def test_restore_takes_the_newest_step_and_persists_a_memory_only_one(tmp_path, tiers):
    with CheckpointManager(**tiers, policy=SavePolicy(local=Every(steps=4))) as mgr:
        for step in range(7):
            mgr.save(step, _state(value=step))
    assert _in_memory(tiers["memory"]) == ["step-5", "step-6"]
    assert "step-6" not in _steps(tiers["local"])
    target = _state()
    with CheckpointManager(**tiers) as mgr:
        assert mgr.restore(target) == 7
        assert mgr.restored_step == 6
    assert torch.equal(target["w"], _state(value=6)["w"])
    assert "step-6" in _steps(tiers["local"])  # persisted down the tiers
    assert (tmp_path / "remote" / "step-6" / "_COMMITTED.json").exists()


def test_restore_falls_back_past_a_corrupt_step_and_says_why(tiers, caplog):
    with CheckpointManager(**tiers, policy=SavePolicy(local=Every(steps=4))) as mgr:
        for step in range(7):
            mgr.save(step, _state(value=step))
    slot = next(
        p
        for p in (tiers["memory"] / "rank-0").glob("slot-*.json")
        if json.loads(p.read_text())["step"] == "step-6"
    )
    data = slot.with_suffix(".data")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 3] ^= 0xFF
    data.write_bytes(bytes(raw))
    target = _state()
    with caplog.at_level(logging.WARNING), CheckpointManager(**tiers) as mgr:
        assert mgr.restore(target) == 6  # step-5, the memory tier's other slot
    assert torch.equal(target["w"], _state(value=5)["w"])
    assert any(
        "step-6" in r.message and "memory" in r.message and "older" in r.message
        for r in caplog.records
    )


def test_restore_waits_for_the_managers_own_save_in_flight(tmp_path, monkeypatch):
    """A rollback while the last save still writes (a loss spike): the restore reads the
    step that save commits, never the one it is replacing, nor a mix of both."""
    local = tmp_path / "local"
    policy = SavePolicy(local=Every(steps=1), remote=None)
    with CheckpointManager(local=local, events=None, policy=policy) as mgr:
        mgr.save(1, _state(value=1))
        mgr.wait()
        gate = Gate(monkeypatch, LocalBackend, "publish")  # the commit's rename, held
        mgr.save(1, _state(value=5))  # a re-save of the step: returns before its commit
        assert gate.entered.wait(30)
        target, done = _state(), []
        restoring = threading.Thread(target=lambda: done.append(mgr.restore(target)))
        restoring.start()
        restoring.join(0.5)
        assert restoring.is_alive()  # waits for the commit
        gate.open.set()
        restoring.join(30)
        assert done == [2] and torch.equal(target["w"], _state(value=5)["w"])


def test_a_step_a_restore_passed_over_unproven_is_moved_aside_when_saved_again(tmp_path, caplog):
    """A restore falls back past a step it could not load but nothing proved bad (one of its
    files briefly not a plain file): the step stays as it is, and training's re-save of that
    step number moves it aside (quarantine) rather than replace it."""
    local = tmp_path / "local"
    policy = SavePolicy(local=Every(steps=1), remote=None)
    keep = {"retention": Retention(local=RetentionPolicy(keep_latest=5))}
    with CheckpointManager(local=local, events=None, policy=policy, **keep) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(value=step))
    data = {s: (local / f"step-{s}" / "__0_0.distcp").read_bytes() for s in (2, 3)}
    for s in (2, 3):
        f = local / f"step-{s}" / "__0_0.distcp"
        f.rename(tmp_path / f"aside-{s}")
        f.mkdir()
    with CheckpointManager(local=local, events=None, policy=policy, **keep) as mgr:  # an evaluation
        assert mgr.restore(_state()) == 2
    assert _steps(local) == ["step-1", "step-2", "step-3"]  # a restore alone moves nothing
    with (
        caplog.at_level(logging.WARNING),
        CheckpointManager(local=local, events=None, policy=policy, **keep) as mgr,
    ):
        assert mgr.restore(_state()) == 2
        for s in (2, 3):
            f = local / f"step-{s}" / "__0_0.distcp"
            f.rmdir()
            (tmp_path / f"aside-{s}").rename(f)  # the condition clears
        mgr.save(2, _state(value=20))  # training goes on from step-1
    aside = [n for n in _hidden_dirs(local) if n.endswith(layout.QUARANTINE_SUFFIX)]
    assert len(aside) == 1 and aside[0].startswith(".step-2.")
    assert (local / aside[0] / "__0_0.distcp").read_bytes() == data[2]  # the old bytes, kept
    assert (local / "step-3" / "__0_0.distcp").read_bytes() == data[3]  # not saved again: as it is
    target = _state()
    with CheckpointManager(local=local, events=None, policy=policy, **keep) as mgr:
        assert mgr.restore(target, step=2) == 3
    assert torch.equal(target["w"], _state(value=20)["w"])


def test_restore_of_nothing_and_of_nothing_valid(tiers):
    with CheckpointManager(**tiers) as mgr:
        assert mgr.restore(_state()) is None
    with CheckpointManager(**tiers, policy=SavePolicy(memory=None)) as mgr:
        mgr.save(0, _state())
    with CheckpointManager(**tiers) as mgr, pytest.raises(ConfigError) as e:
        mgr.restore({"other": torch.zeros(3)})  # a different model: nothing fits
    assert "step-0" in str(e.value) and "state_dict: other" in str(e.value)  # the key
    assert (tiers["local"] / "step-0").is_dir()  # kept: not proven bad


@pytest.mark.parametrize("broken", ["unreachable", "no-such-bucket"])
def test_restore_never_starts_from_scratch_when_the_remote_cannot_be_read(
    tmp_path, s3, broken, caplog
):
    """A fresh node (no memory, no disk) whose remote cannot be read: restore raises
    TierUnavailableError naming the tier and the cause, never "nothing to restore" (which
    would start training from step 0 beside the real history). Opting in restores from what
    can be read, with an ERROR."""
    from dcp_tiered import (
        PermanentTierError,
        RemoteConfig,
        RetryConfig,
        SaveFailedError,
        TierUnavailableError,
    )

    endpoint = "http://127.0.0.1:9" if broken == "unreachable" else None  # nothing listens
    bucket = s3.bucket if broken == "unreachable" else "no-such-bucket-dcp-tiered"
    remote = RemoteConfig(
        url=f"s3://{bucket}/run",
        storage_options=s3.options(endpoint, retries=0),  # RetryConfig's 2 attempts alone
        retry=RetryConfig(max_attempts=2, initial_backoff_secs=0.05),
    )
    tiers = {"memory": tmp_path / "shm", "local": tmp_path / "disk", "remote": remote}
    if broken == "no-such-bucket":  # permanent: refused when the manager starts, not later
        with pytest.raises(PermanentTierError) as e:
            CheckpointManager(**tiers)
        assert "NoSuchBucket" in str(e.value) and "create the bucket" in str(e.value)
        return
    with CheckpointManager(**tiers) as mgr:
        with pytest.raises(TierUnavailableError) as e:
            mgr.restore(_state())
        assert f"s3://{bucket}/run" in str(e.value)
        assert "Connect" in str(e.value)
        assert "on_unreadable_tier='skip'" in str(e.value)
        with caplog.at_level(logging.ERROR):
            assert mgr.restore(_state(), on_unreadable_tier="skip") is None
        assert "on_unreadable_tier='skip'" in caplog.text
    mgr = CheckpointManager(**tiers)
    mgr.save(0, _state(), force=True)  # the disk takes it; its upload fails
    with pytest.raises(SaveFailedError, match="remote tier"):
        mgr.close()
    with CheckpointManager(**tiers) as mgr:  # a local step: still no guessing by default
        with pytest.raises(TierUnavailableError):
            mgr.restore(_state())
        assert mgr.restore(_state(), on_unreadable_tier="skip") == 1


def test_a_save_that_does_not_fit_is_skipped_or_refused_and_writes_nothing(tmp_path, tmpfs):
    shm = tmpfs(4)
    adm = Admission(memory_margin_bytes=0)
    with CheckpointManager(memory=shm, local=tmp_path / "disk", admission=adm) as mgr:
        assert mgr.save(1, _state(8)) == Decision()  # 8 MiB into a 4 MiB memory tier
        assert mgr.skipped_saves == 1
        assert mgr.save(10, _state(8)).local  # the disk still takes it
    assert _in_memory(shm) == [] and not list(shm.rglob("*.data"))
    assert [e["reason"] for e in _events(tmp_path / "disk") if e["event"] == "skipped"]
    strict = Admission(memory_margin_bytes=0, when_full="raise")
    with CheckpointManager(memory=shm, local=tmp_path / "disk", admission=strict) as mgr:
        with pytest.raises(InsufficientSpaceError, match="memory tier has 4 MiB free; .* 16 MiB"):
            mgr.save(1, _state(8))
    assert _in_memory(shm) == [] and not list(shm.rglob("*.data"))


def test_a_save_that_stops_fitting_follows_the_admission_policy(tmp_path, tmpfs):
    """The state grows past the estimate (optimizer state appears after the first step): the
    admission check passes on the old size and the write finds no room. Under the default
    when_full='skip' that save is skipped with a warning and an event, the next ones are
    refused before writing, nothing raises, and the earlier step is intact; with 'raise' the
    next save raises SaveFailedError naming the cause."""
    disk = tmpfs(6)
    policy = SavePolicy(local=Every(steps=1))
    options = {"free_space_margin_bytes": 0}
    lenient = Admission(disk_margin_bytes=0, memory_margin_bytes=0)
    with CheckpointManager(
        local=disk, policy=policy, writer_options=options, admission=lenient
    ) as mgr:
        mgr.save(0, _state(1))  # 1 MiB: fits
        mgr.save(1, _state(8))  # 8 MiB: admitted on the 1 MiB estimate, then no room
        mgr.wait()
        assert mgr.skipped_saves == 1  # not a failure to raise at the next save
        assert mgr.save(2, _state(8)) == Decision()  # refused before writing: known size now
        assert mgr.skipped_saves == 2
    skipped = [e for e in _events(disk) if e["event"] == "skipped"]
    assert [e["step"] for e in skipped] == [1, 2] and "InsufficientSpaceError" in skipped[0][
        "reason"
    ]
    assert sorted(p.name for p in disk.glob("step-*")) == ["step-0"]
    back = _state(1, value=7.0)
    with CheckpointManager(local=disk) as mgr:
        assert mgr.restore(back) == 1 and torch.equal(back["w"], _state(1)["w"])
    strict = Admission(disk_margin_bytes=0, memory_margin_bytes=0, when_full="raise")
    with CheckpointManager(
        local=disk, policy=policy, writer_options=options, admission=strict
    ) as mgr:
        mgr.save(3, _state(1))
        mgr.save(4, _state(8))
        mgr.wait()  # step 4's write has failed by now
        with pytest.raises(SaveFailedError, match="InsufficientSpaceError"):
            mgr.save(5, _state(1))


def test_in_flight_cap_skips_or_blocks(tiers):
    state = _state(64)
    every_step = SavePolicy(memory=None, local=Every(steps=1), remote=None)
    with CheckpointManager(
        **tiers,
        policy=every_step,
        writer_options={"sync_files": False},
        admission=Admission(max_in_flight=1, when_busy="skip"),
    ) as mgr:
        mgr.save(0, state)
        assert mgr.save(1, state) == Decision()  # the first is still being written
        assert mgr.skipped_saves == 1
    with CheckpointManager(
        **tiers,
        policy=every_step,
        writer_options={"sync_files": False},
        admission=Admission(max_in_flight=1, when_busy="block"),
    ) as mgr:
        mgr.save(2, state)
        assert mgr.save(3, state).local  # waited for step 2 instead
        assert mgr.skipped_saves == 0
    assert {"step-2", "step-3"} <= set(_steps(tiers["local"]))


def test_every_save_emits_an_event_with_timings_and_durability(tmp_path, tiers):
    with CheckpointManager(
        **tiers, policy=SavePolicy(local=Every(steps=2), remote=Every(steps=4))
    ) as mgr:
        for step in range(5):
            mgr.save(step, _state(1))
    saved = {e["step"]: e for e in _events(tiers["local"]) if e["event"] == "saved"}
    assert sorted(saved) == [0, 1, 2, 3, 4]
    for e in saved.values():
        assert e["bytes"] == MIB and e["rank"] == 0
        assert e["stall_s"] >= e["stage_s"] > 0 and e["local_write_s"] > 0 and e["commit_s"] > 0
    assert [s for s, e in saved.items() if e["tier"] == "memory"] == [1, 3]
    for step in (0, 4):  # due remotely: upload time and when it became durable
        e = saved[step]
        assert e["remote"] and e["upload_s"] > 0 and e["durable_at"] >= e["time"] - 60
        assert e["durable_after_s"] >= e["upload_s"]
    assert saved[2]["durable_at"] is None


def test_status_shows_every_tier_and_its_durability(tmp_path, tiers, capsys):
    with CheckpointManager(
        **tiers, policy=SavePolicy(local=Every(steps=2), remote=Every(steps=4))
    ) as mgr:
        for step in range(4):
            mgr.save(step, _state())
    assert cli(["status", str(tiers["local"])]) == 0
    out = capsys.readouterr().out
    rows = {
        line.split()[0]: line.split()[1:] for line in out.splitlines() if line.startswith("step-")
    }
    assert rows["step-0"] == ["-", "-", "yes", "yes", "durable-remote"]
    assert rows["step-2"] == ["-", "-", "yes", "-", "committed-local"]
    assert rows["step-3"] == ["yes", "-", "-", "-", "memory"]
    assert cli(["status", str(tiers["local"]), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["memory"] == str(tiers["memory"]) and len(data["steps"]) == 4  # step-1 too


def test_rank_state_round_trips_and_tolerates_a_step_saved_by_fewer_ranks(
    tiers, monkeypatch, caplog
):
    sched_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
    sched_opt.step()
    sched.step()
    app = {"m": _state(), "rank": RankState(lr_scheduler=sched)}
    torch.manual_seed(7)
    with CheckpointManager(**tiers) as mgr:
        mgr.save(0, app)
    expected = torch.rand(3)
    fresh = torch.optim.lr_scheduler.StepLR(sched_opt, step_size=1, gamma=0.5)
    app = {"m": _state(), "rank": RankState(lr_scheduler=fresh)}
    with CheckpointManager(**tiers) as mgr:
        mgr.restore(app)
    assert torch.equal(torch.rand(3), expected) and fresh.last_epoch == sched.last_epoch
    monkeypatch.setattr(rank_state, "global_rank", lambda: 1)  # a rank the step never had
    app = {"m": _state(), "rank": RankState()}
    with caplog.at_level(logging.WARNING), CheckpointManager(**tiers) as mgr:
        assert mgr.restore(app) == 1
    assert not app["rank"].restored
    assert any(
        "no rank state for rank" in r.message or "holds no rank" in r.message
        for r in caplog.records
    )


class Position:
    """A user's own class in a state: torch's weights_only loading refuses it. (io.BytesIO is
    refused too, unless a framework imported in the process allowlisted it: megatron-core
    does, with torch.serialization.add_safe_globals.)"""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def getvalue(self) -> bytes:
        return self.text


def test_a_state_that_could_not_be_restored_is_refused_at_its_first_save_unless_trusted(tiers):
    """A value weights_only loading refuses saves, but could never be restored: without
    allow_pickle the first save says so and writes nothing; with it, every tier restores it."""
    state = {**_state(), "blob": Position(b"loader position 17"), "note": {"epoch": [1, 2]}}
    policy = SavePolicy(memory=Every(steps=1), local=Every(steps=2), remote=Every(steps=2))
    with CheckpointManager(**tiers, policy=policy) as mgr:
        with pytest.raises(ConfigError, match=r"'blob' \(Position\).*allow_pickle=True"):
            mgr.save(0, state)
    assert not any(tiers["local"].glob("step-*")) and not any(tiers["memory"].rglob("slot-*"))
    with CheckpointManager(**tiers, policy=policy, allow_pickle=True) as mgr:
        for step in range(4):
            mgr.save(step, state)
    # step-3 from memory (then persisted to disk by the restore), then from disk alone.
    for tier_left in ("memory", "local"):
        if tier_left == "local":
            shutil.rmtree(tiers["memory"])
        back = {**_state(value=9.0), "blob": Position(b""), "note": {"epoch": [0, 0]}}
        with CheckpointManager(**tiers, allow_pickle=True) as mgr:
            assert mgr.restore(back) == 4
        assert back["blob"].getvalue() == b"loader position 17" and back["note"]["epoch"] == [1, 2]


def _flip(data: bytes) -> bytes:
    raw = bytearray(data)
    raw[len(raw) // 2] ^= 0xFF
    return bytes(raw)


def test_steps_a_restore_fell_back_past_are_quarantined_and_saved_again(tmp_path, s3):
    """Every tier holds a corrupt step-3: the restore falls back to step-2, and training then
    saves step 3 again, on every tier, instead of failing on the abandoned copies."""
    import s3fs

    from dcp_tiered import RemoteConfig

    remote = RemoteConfig(url=s3.url(), storage_options=s3.options())
    tiers = {"memory": tmp_path / "shm", "local": tmp_path / "disk", "remote": remote}
    every = SavePolicy(memory=Every(steps=1), local=Every(steps=1), remote=Every(steps=1))
    with CheckpointManager(**tiers, policy=every) as mgr:
        for step in range(4):
            mgr.save(step, _state(value=step))
    for slot in (tiers["memory"] / "rank-0").glob("slot-*.json"):
        if json.loads(slot.read_text())["step"] == "step-3":
            slot.with_suffix(".data").write_bytes(_flip(slot.with_suffix(".data").read_bytes()))
    for data in (tiers["local"] / "step-3").glob("*.distcp"):
        data.write_bytes(_flip(data.read_bytes()))
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **s3.options())
    for key in fs.find(f"{remote.url.removeprefix('s3://')}/step-3"):
        if key.endswith(".distcp"):
            fs.pipe(key, _flip(fs.cat(key)))
    target = _state()
    with CheckpointManager(**tiers, policy=every) as mgr:
        assert mgr.restore(target) == 3
        assert torch.equal(target["w"], _state(value=2)["w"])
        mgr.save(3, _state(value=33))  # the abandoned step-3 no longer stands in the way
    assert [n for n in _hidden_dirs(tiers["local"]) if n.endswith(".dcp-tiered-quarantined")]
    assert any("/step-3/_quarantined/" in k for k in fs.find(remote.url.removeprefix("s3://")))
    fresh = {"memory": None, "local": tmp_path / "fresh", "remote": remote}
    with CheckpointManager(**fresh) as mgr:  # a new node: only the remote tier
        assert mgr.restore(target) == 4
    assert torch.equal(target["w"], _state(value=33)["w"])


def test_a_corrupt_local_step_the_remote_does_not_hold_yet_is_quarantined(tmp_path):
    """A remote tier is configured but the newest step is not due there (every 10 steps):
    its local copy, proven corrupt by its checksum, is quarantined by the restore, which
    falls back to the step before; not kept as "not proven bad" because the remote has no
    copy to read instead."""
    tiers = {"memory": None, "local": tmp_path / "disk", "remote": f"file://{tmp_path}/remote"}
    policy = SavePolicy(memory=None, local=Every(steps=1), remote=Every(steps=10))
    with CheckpointManager(**tiers, policy=policy) as mgr:
        for step in range(3):
            mgr.save(step, _state(value=step))
    for data in (tiers["local"] / "step-2").glob("*.distcp"):
        data.write_bytes(_flip(data.read_bytes()))
    target = _state()
    with CheckpointManager(**tiers, policy=policy) as mgr:
        assert mgr.restore(target) == 2 and mgr.restored_step == 1
    assert torch.equal(target["w"], _state(value=1)["w"])
    assert not (tiers["local"] / "step-2").exists()
    assert [n for n in _hidden_dirs(tiers["local"]) if n.startswith(".step-2.")]


@pytest.mark.parametrize("memory", [False, True])
def test_a_state_no_step_fits_raises_config_error_and_keeps_every_step(tmp_path, memory):
    """Every step is there but none fits the state being loaded (another model): the restore
    says so (ConfigError naming each step's mismatch), not "no step found", and keeps them."""
    tiers = {"memory": tmp_path / "shm" if memory else None, "local": tmp_path / "disk"}
    every = SavePolicy(memory=Every(steps=1) if memory else None, local=Every(steps=1))
    with CheckpointManager(**tiers, policy=every) as mgr:
        for step in range(2):
            mgr.save(step, {"model": {"w": torch.full((2, 4), float(step))}})
    with CheckpointManager(**tiers, policy=every) as mgr:
        with pytest.raises(ConfigError, match=r"does not fit any of the steps") as e:
            mgr.restore({"model": {"w": torch.zeros(2, 5)}})
    assert "step-1" in str(e.value) and "step-0" in str(e.value)
    assert sorted(p.name for p in tiers["local"].glob("step-*")) == ["step-0", "step-1"]
    assert not [n for n in _hidden_dirs(tiers["local"]) if "quarantined" in n]


@pytest.mark.parametrize("cores,want", [(2, 1), (3, 1), (4, 2), (64, 2)])
def test_the_managers_saves_leave_training_a_core_on_a_small_machine(
    tmp_path, monkeypatch, cores, want
):
    """The manager saves beside training: fewer than four usable cores, one writer thread
    (two shared a core with the training thread, nice or not); an explicit one is kept."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    mgr = CheckpointManager(local=tmp_path / "a", events=None)
    try:
        assert mgr._local.config.thread_count == want
    finally:
        mgr.close()
    mgr = CheckpointManager(local=tmp_path / "b", events=None, writer_options={"thread_count": 3})
    try:
        assert mgr._local.config.thread_count == 3
    finally:
        mgr.close()
