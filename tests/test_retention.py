"""Retention under random sequences of saves, promotions, failures and deletions.

A hypothesis state machine drives a model of the three tiers through saves (some in flight
while retention runs), promotions that succeed or fail, and deletions by someone else, and
runs the real policy on every tier as production does: ``retention.decide`` on the local tier,
asking the model what ``housekeeping.awaiting_remote`` asks the store (does the step's
manifest ask for promotion, and does the remote not hold it?), and ``retention.evictions`` on
the memory and remote tiers. A second test runs the real pass (``housekeeping.local_pass``,
with the real ``awaiting_remote``) on real directories written by the real writer.
"""

from __future__ import annotations

import json
import os
import time

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dcp_tiered import (
    SaveRequest,
    RemoteConfig,
    RetentionPolicy,
    RetryConfig,
    TieredStorageWriter,
    UploadFailedError,
)
from dcp_tiered.policy import layout, step_names
from dcp_tiered.policy.retention import StepState, decide, evictions, superseded
from dcp_tiered.tiers import housekeeping
from dcp_tiered.tiers.root import Tiers as RootTiers

POLICIES = st.builds(
    RetentionPolicy,
    keep_latest=st.integers(1, 3),
    keep_every=st.none() | st.integers(2, 5),
    pinned=st.frozensets(st.sampled_from([f"step-{n}" for n in range(12)]), max_size=2),
)


class Tiers(RuleBasedStateMachine):
    """memory, local and remote hold committed steps; local steps may await the remote."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = RetentionPolicy()
        self.tiers: dict[str, dict[str, int]] = {"memory": {}, "local": {}, "remote": {}}
        self.promote: set[str] = set()  # local steps whose manifest asks for promotion
        self.in_flight: tuple[str, str, bool] | None = None
        self.step = 0
        self.clock = 0
        self.evicted: list[tuple[str, str, bool]] = []

    @rule(policy=POLICIES)
    def set_policy(self, policy: RetentionPolicy) -> None:
        self.policy = policy

    def _next(self) -> str:
        self.step += 1
        self.clock += 1
        return f"step-{self.step}"

    @rule(tier=st.sampled_from(["memory", "local"]), promote=st.booleans(), wait=st.booleans())
    def save(self, tier: str, promote: bool, wait: bool) -> None:
        if self.in_flight is not None:
            self.commit()
        name = self._next()
        self.in_flight = (tier, name, promote and tier == "local")
        if not wait:
            self.commit()

    @precondition(lambda self: self.in_flight is not None)
    @rule()
    def commit(self) -> None:
        assert self.in_flight is not None
        tier, name, promote = self.in_flight
        self.in_flight = None
        self.tiers[tier][name] = self.clock
        if promote:
            self.promote.add(name)

    @property
    def awaiting(self) -> set[str]:
        """Local steps not durable on the remote: what ``housekeeping.awaiting_remote`` finds
        (promotion asked for, and the store does not hold the save), including a step whose
        remote copy someone else (or the remote's retention) deleted."""
        local, remote = self.tiers["local"], self.tiers["remote"]
        return {n for n in self.promote if n in local and n not in remote}

    @precondition(lambda self: bool(self.awaiting))
    @rule(data=st.data(), ok=st.booleans())
    def promotion(self, data: st.DataObject, ok: bool) -> None:
        name = data.draw(st.sampled_from(sorted(self.awaiting)))
        if ok:
            self.tiers["remote"][name] = self.tiers["local"][name]
        # a failed promotion leaves the step awaiting: it is retried at the next start

    @rule(data=st.data(), tier=st.sampled_from(["memory", "local", "remote"]))
    def deleted_by_someone_else(self, data: st.DataObject, tier: str) -> None:
        if self.tiers[tier]:
            name = data.draw(st.sampled_from(sorted(self.tiers[tier])))
            del self.tiers[tier][name]
            if tier == "local":
                self.promote.discard(name)  # nothing left to promote

    @rule(tier=st.sampled_from(["memory", "local", "remote"]))
    def retention(self, tier: str) -> None:
        before = dict(self.tiers[tier])
        awaiting = self.awaiting if tier == "local" else set()
        states = [StepState(n, t) for n, t in before.items()]
        if tier == "local":  # housekeeping.local_pass
            asked: list[str] = []

            def awaiting_remote(name: str) -> bool:
                asked.append(name)
                return name in awaiting

            doomed, held = decide(states, self.policy, awaiting_remote)
            assert set(held) == set(asked) & awaiting, "held a durable step, or deleted one not"
            # only the steps the policy would delete are asked about (each costs a listing)
            assert sorted(asked) == sorted(evictions(states, self.policy))
        else:  # no lower tier to wait for (housekeeping.prune_remote on the remote)
            doomed = evictions(states, self.policy)
        assert set(doomed) <= set(before), "evicted a step the tier does not hold"
        if self.in_flight is not None:
            assert self.in_flight[1] not in doomed
        for name in doomed:
            assert name not in awaiting, f"evicted {name} before it was durable on the remote"
            del self.tiers[tier][name]
            if tier == "local":
                self.promote.discard(name)
        if before:
            newest = step_names.newest(before.items())
            assert newest in self.tiers[tier], f"evicted the newest step {newest} of {tier}"
        for name in before:
            num = step_names.order_number(name)
            protected = (
                name in self.policy.pinned
                or (self.policy.keep_every and num % self.policy.keep_every == 0)
                or name in awaiting
            )
            if protected:
                assert name in self.tiers[tier], f"evicted protected {name}"
        # It did its job: besides protected steps, at most keep_latest remain.
        unprotected = [
            n
            for n in self.tiers[tier]
            if n not in self.policy.pinned
            and not (
                self.policy.keep_every and step_names.order_number(n) % self.policy.keep_every == 0
            )
            and n not in awaiting
        ]
        assert len(unprotected) <= self.policy.keep_latest

    @invariant()
    def newest_durable_step_survives(self) -> None:
        # The newest step ever committed anywhere is only gone if someone else deleted it.
        every = {n for t in self.tiers.values() for n in t}
        if every:
            newest = max(every, key=step_names.order_number)
            assert any(newest in t for t in self.tiers.values())


TestRetentionStateMachine = Tiers.TestCase
TestRetentionStateMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)


@pytest.mark.parametrize("keep_latest", [1, 2])
def test_evictions_keep_milestones_pins_and_the_newest(keep_latest):
    steps = [StepState(f"step-{n}", n) for n in range(1, 11)]
    policy = RetentionPolicy(keep_latest=keep_latest, keep_every=5, pinned={"step-3"})
    kept = {s.name for s in steps} - set(evictions(steps, policy))
    assert kept == {"step-3", "step-5", "step-10"} | {f"step-{10 - i}" for i in range(keep_latest)}


def test_keep_latest_zero_is_refused():
    with pytest.raises(ValueError, match="keep_latest must be >= 1"):
        RetentionPolicy(keep_latest=0)


# ---------------------------------------------------------------- real directories


def _save(writer: TieredStorageWriter, step: int, promote: bool) -> None:
    dcp.save(
        {"w": torch.full((64,), float(step))},
        checkpoint_id=SaveRequest(f"step-{step}", promote=promote),
        storage_writer=writer,
        no_dist=True,
    )


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=7), policy=POLICIES
)
def test_prune_local_on_real_directories(tmp_path_factory, ops, policy):
    """Saves that are promoted or not, uploads that succeed or not (a remote we break):
    the real prune never deletes a step whose upload did not finish, nor the newest."""
    tmp = tmp_path_factory.mktemp("prune")
    remote_dir = tmp / "remote"
    remote_dir.mkdir()
    remote = RemoteConfig(
        url=f"file://{remote_dir}", retry=RetryConfig(max_attempts=1, initial_backoff_secs=0.01)
    )
    tiers = RootTiers.open(tmp / "local", remote)
    writer = TieredStorageWriter(tiers, sync_files=False)
    awaiting = set()
    for step, (promote, upload_ok) in enumerate(ops):
        if not upload_ok:  # a file where the step's directory must go: its upload fails
            (remote_dir / f"step-{step}").write_bytes(b"")
        _save(writer, step, promote)
        if promote:
            try:
                writer.wait_durable(f"step-{step}", timeout_secs=30)
            except UploadFailedError:
                awaiting.add(f"step-{step}")
        assert (f"step-{step}" in awaiting) == (promote and not upload_ok)
    before = {s.name for s in tiers.local.steps()}
    dry = housekeeping.local_pass(
        tiers.local, policy, tiers.remote, label="local", dry_run=True
    )  # what `dcp-tiered prune --dry-run` says: the same pass, deleting nothing
    assert {s.name for s in tiers.local.steps()} == before
    assert not set(dry.held) & set(dry.deleted) and set(dry.held) <= awaiting
    deleted = housekeeping.prune_local(tiers.local, policy, tiers.remote, label="local")
    after = {s.name for s in tiers.local.steps()}
    assert after == before - set(deleted)
    assert deleted == dry.deleted and sorted(dry.kept) == sorted(after)
    assert not set(deleted) & awaiting
    assert f"step-{len(ops) - 1}" in after
    assert not [n for n in os.listdir(tmp / "local") if n.endswith(layout.DELETE_SUFFIX)]
    writer.close(wait_durable=False)  # the failed uploads are the point: nothing to wait for


# ---------------------------------------------------------------- the remote's own policy


def test_superseded_is_what_the_policy_would_drop_on_arrival():
    kept = [StepState(f"step-{n}", n) for n in (4, 5)]
    latest_one = RetentionPolicy(keep_latest=1)
    assert superseded(StepState("step-3", 3), kept, latest_one)
    assert not superseded(StepState("step-6", 6), kept, latest_one)  # the newest: kept
    milestones = RetentionPolicy(keep_latest=1, keep_every=3)
    assert not superseded(StepState("step-3", 3), kept, milestones)  # a milestone: kept
    assert not superseded(StepState("step-3", 3), kept, RetentionPolicy(keep_latest=3))


def test_a_step_the_remote_retention_dropped_is_not_uploaded_again_by_the_next_job(
    tmp_path, caplog, capsys
):
    """Remote keeps 1, local keeps 2: each job's start used to upload the local step the
    remote's retention had just deleted, every restart a whole checkpoint sent for nothing
    (and, with no save to prune after it, left on the remote). A step the remote's policy
    would keep (newer than what it holds) is still uploaded by the next job."""
    from dcp_tiered import CheckpointManager, Every, Retention, SavePolicy

    remote_dir = tmp_path / "remote"
    remote = RemoteConfig(
        url=f"file://{remote_dir}", retry=RetryConfig(max_attempts=1, initial_backoff_secs=0.01)
    )

    def job(step: int | None) -> None:
        mgr = CheckpointManager(
            local=tmp_path / "local",
            remote=remote,
            policy=SavePolicy(local=Every(steps=1), remote=Every(steps=1)),
            retention=Retention(
                local=RetentionPolicy(keep_latest=2), remote=RetentionPolicy(keep_latest=1)
            ),
        )
        try:
            if step is not None:
                mgr.save(step, {"w": torch.full((64,), float(step))})
        finally:
            try:
                mgr.close(timeout_secs=60)
            except Exception:  # noqa: BLE001 - the broken upload below: the point
                pass

    def steps(where) -> list[str]:
        return sorted(n for n in os.listdir(where) if layout.is_step_name(n))

    caplog.set_level("INFO", logger="dcp_tiered")
    for step in (1, 2, 3):
        job(step)
    caplog.clear()
    job(None)  # a restart that saves nothing
    uploaded = [r.getMessage() for r in caplog.records if "uploaded step=" in r.getMessage()]
    assert uploaded == []
    assert steps(remote_dir) == ["step-3"]
    assert steps(tmp_path / "local") == ["step-2", "step-3"]  # step-1: dropped by both
    # and `dcp-tiered status` (which finds the remote and its policy in the root) says so
    from dcp_tiered.cli import main

    assert main(["status", str(tmp_path / "local"), "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)["steps"]}
    assert rows["step-2"]["remote_dropped"] is True
    assert rows["step-2"]["durability"] == (
        "committed-local (the remote's retention does not keep it: no upload)"
    )
    assert rows["step-3"]["durability"] == "durable-remote"

    (remote_dir / "step-4").write_bytes(b"")  # a file where the step goes: its upload fails
    job(4)
    assert steps(tmp_path / "local") == ["step-3", "step-4"]  # step-4: the only copy, kept
    (remote_dir / "step-4").unlink()
    job(None)  # the remote would keep step-4: this job's start uploads it (in the background)
    marker = remote_dir / "step-4" / layout.REMOTE_MARKER
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()
