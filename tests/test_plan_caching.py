"""DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) on 2 real gloo ranks: the
later saves replay DCP's cached plan, and each one is still its own step, save id and commit."""

from __future__ import annotations

import pytest

from tests.conftest import read_json, torchrun

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize(
    "mode,nodes,remote",
    [
        ("sync", 1, True),  # one root; step-2 kept local, the others promoted
        ("thread", 2, True),  # two roots: the cross-node commit handshake on every save
        ("process", 2, False),  # the writer is a fresh copy in DCP's subprocess every save
    ],
)
def test_cached_plans_commit_every_step_exactly(tmp_path, mode, nodes, remote):
    out, log = tmp_path / "out.json", tmp_path / "plans"
    args = [
        "--root",
        str(tmp_path / "ck"),
        "--nodes",
        str(nodes),
        "--mode",
        mode,
        "--plan-log",
        str(log),
        "--out",
        str(out),
    ]
    if remote:
        args += ["--remote", (tmp_path / "remote").as_uri()]
    torchrun("plan_caching.py", 2, *args, timeout=300)
    res = read_json(out)
    # DCP sent each rank's plan once, then found it unchanged and replayed the cached one.
    assert [(tmp_path / f"plans.{r}").read_text() for r in (0, 1)] == ["10000"] * 2
    for r, found in enumerate(res["ranks"]):
        assert found["bad"] == [], found
        assert list(found["errors"]) == ["step-x" if r else "step-4"], found["errors"]
        assert all("ranks disagree on the step name" in e for e in found["errors"].values())
    committed = ["step-1", "step-2", "step-3", "step-5"]
    roots = [f"node{n}" for n in range(nodes)] if nodes > 1 else ["ck"]
    assert res["entries"] == {r: committed for r in roots}  # nothing of step-4 / step-x
    assert res["steps"] == {f"{r}/{s}": s for r in roots for s in committed}
    ids = res["save_ids"]
    assert len({ids[f"{roots[0]}/{s}"] for s in committed}) == 4  # a new save id every save
    assert all(ids[f"{r}/{s}"] == ids[f"{roots[0]}/{s}"] for r in roots for s in committed)
    if remote:
        assert res["durability"] == {
            "step-1": "durable-remote",
            "step-2": "committed-local",
            "step-3": "durable-remote",
            "step-5": "durable-remote",
        }


@pytest.fixture(scope="module")
def sharing(tmp_path_factory):
    """Three saves of two states with the manager's planner on 2 gloo ranks (one run)."""
    tmp = tmp_path_factory.mktemp("sharing")
    out = tmp / "out.json"
    torchrun("plan_sharing.py", 2, "--root", str(tmp / "ck"), "--out", str(out), timeout=300)
    return read_json(out)


def test_cached_plans_are_kept_once_on_every_rank(sharing):
    """DCP's plan caching keeps four plans for the life of the process (the local plan, every
    rank's local plan on the coordinator, the global plan, the final plan), each a copy
    unpickled from its collective: 1.2 million objects for 20,000 tensors, which every full
    garbage collection walks. Equal plans are kept as one set of objects."""
    alike, mixed = zip(*((r["alike"], r["mixed"]) for r in sharing))
    for report in alike + mixed:  # every final plan's tensor data is the local plan's
        assert report["final_data_from_local"] == report["final_items"] > 0, report
    # 40 tensors every rank holds alike: one set of tensor data on each rank (was 140, 60);
    # the coordinator's copy of rank 1's identical plan is rank 0's own
    assert [r["distinct_tensor_data"] for r in alike] == [40, 40]
    # plus 30 tensors of each rank's own: rank 1's plan is a copy of its own on rank 0
    assert [r["local_items"] for r in mixed] == [70, 70]
    assert [r["distinct_tensor_data"] for r in mixed] == [140, 70]
    # the coordinator's final plan is its global plan: no items beyond local and global
    assert alike[0]["distinct_items"] == 40 + 40 and mixed[0]["distinct_items"] == 140 + 100


def test_every_rank_gets_the_steps_own_metadata_from_dcp_save(sharing):
    """At the end of a save DCP broadcasts the coordinator's metadata (the plan cache's, the
    same object every save). It is sent as the bytes of the step's ``.metadata``: the other
    rank gets a plain ``Metadata`` naming this step, with every item's storage data (the
    cached object named the first save's step and had none)."""
    for name, items in (("alike", 40), ("mixed", 100)):
        coordinator, other = (r[name]["returned"] for r in sharing)
        assert other == [["Metadata", f"step-{i}", items, items] for i in range(3)], other
        # the coordinator's own: the planner's cached object (a Metadata), as before
        assert [r[0] for r in coordinator] == ["BroadcastMetadata"] * 3
