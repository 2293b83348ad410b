"""Peer replication's partner maths and the memory tier's lease, in one process (the
multi-node behaviour is in tests/test_replication.py)."""

from __future__ import annotations

import pytest
import torch

from dcp_tiered.errors import ConfigError, IntegrityError
from dcp_tiered.policy.replication import (
    Replication,
    Survey,
    describe_lost,
    node_of,
    node_partners,
    rank_partners,
    sources,
)
from dcp_tiered.tiers.memory import MemoryTier


def test_a_ring_sends_each_node_to_the_next_ones_never_to_itself():
    nodes = ["node-10", "node-9", "node-2"]  # natural order: 2, 9, 10
    assert node_partners(nodes, 1, "ring") == {
        "node-2": ["node-9"],
        "node-9": ["node-10"],
        "node-10": ["node-2"],
    }
    two = node_partners(["a", "b", "c", "d"], 2, "ring")
    assert two["a"] == ["b", "c"] and two["d"] == ["a", "b"]
    assert all(n not in ps for n, ps in two.items())


def test_pairs_keep_copies_inside_groups_and_an_odd_node_joins_the_last_group():
    pairs = node_partners(["0", "1", "2", "3"], 1, "pairs")
    assert pairs == {"0": ["1"], "1": ["0"], "2": ["3"], "3": ["2"]}
    odd = node_partners(["0", "1", "2", "3", "4"], 1, "pairs")
    assert odd["0"] == ["1"] and odd["1"] == ["0"]
    assert odd["2"] == ["3"] and odd["3"] == ["4"] and odd["4"] == ["2"]


def test_ranks_map_to_the_same_index_on_the_partner_node():
    partners = rank_partners(["0", "0", "1", "1", "2", "2"], 1, "ring")
    assert partners == {0: [2], 1: [3], 2: [4], 3: [5], 4: [0], 5: [1]}
    assert sources(partners) == {0: [4], 1: [5], 2: [0], 3: [1], 4: [2], 5: [3]}


def test_too_few_nodes_or_uneven_nodes_are_refused_with_what_to_do():
    with pytest.raises(ConfigError, match="needs at least 2 nodes.*runs on 1"):
        rank_partners(["host", "host"], 1, "ring")
    with pytest.raises(ConfigError, match="same number of ranks"):
        rank_partners(["a", "a", "b"], 1, "ring")
    with pytest.raises(ConfigError, match="grouping"):
        Replication(grouping="star")
    with pytest.raises(ConfigError, match="factor"):
        Replication(factor=0)


def test_the_node_id_comes_from_the_launcher_or_the_configured_key():
    assert node_of({"GROUP_RANK": "3", "NODE_RANK": "9"}, None, "h") == "3"
    assert node_of({"SLURM_NODEID": "4"}, None, "h") == "4"
    assert node_of({}, None, "host-7") == "host-7"
    assert node_of({"MY_NODE": "x"}, "MY_NODE", "h") == "x"
    with pytest.raises(ConfigError, match=r"\$MY_NODE is not set"):
        node_of({}, "MY_NODE", "h")


def test_the_survey_finds_the_newest_step_every_rank_can_get_whole():
    # Rank 0's node is gone; rank 1 keeps its copies of steps 6 and 7 ... but only 6 of rank 2's.
    survey = Survey(
        own=[[], ["step-6", "step-7"], ["step-6", "step-7"]],
        held=[{}, {0: ["step-6", "step-7"]}, {1: ["step-6", "step-7"]}],
        nodes=["n0", "n1", "n2"],
    )
    assert survey.copies("step-7", 0) == [1]
    assert survey.copies("step-7", 1) == ["own", 2]
    assert survey.whole() == ["step-7", "step-6"]
    lost_together = Survey(
        own=[[], [], ["step-6", "step-7"]],
        held=[{}, {}, {1: ["step-6", "step-7"]}],
        nodes=["n0", "n1", "n2"],
    )
    assert lost_together.whole() == []
    assert lost_together.lost(5) == {"step-7": [0], "step-6": [0]}
    text = describe_lost(lost_together, lost_together.lost(5), "step-5 from the local tier")
    assert "6, 7 were lost" in text and "rank(s) 0 (node(s) n0)" in text
    assert "restoring step-5 from the local tier" in text


def _state(value: float) -> dict:
    return {"w": torch.full((256,), float(value)), "n": int(value)}


def test_a_leased_slot_is_never_overwritten_and_a_crash_still_leaves_a_snapshot(tmp_path):
    mem = MemoryTier(tmp_path / "m", 0)
    mem.save("step-1", _state(1)).result()
    mem.save("step-2", _state(2)).result()
    lease = mem.lease("step-1")  # being sent to a partner
    assert lease is not None
    _, data = lease
    mem.save("step-3", _state(3)).result()  # would go to step-1's slot: goes to step-2's
    assert set(mem.steps()) == {"step-1", "step-3"}
    assert torch.equal(data[:1024].view(torch.float32), torch.full((256,), 1.0))
    mem.release()
    mem.save("step-4", _state(4)).result()  # now the oldest (step-1) slot is reused
    assert set(mem.steps()) == {"step-3", "step-4"}
    mem.close()


def test_a_received_copy_is_verified_before_its_header_commits_it(tmp_path):
    mine = MemoryTier(tmp_path / "a", 0)
    mine.save("step-1", _state(1)).result()
    header, data = mine.lease("step-1")
    mine.release()
    copy = MemoryTier(tmp_path / "b", 0, directory="replica-0")

    def torn(buffer: torch.Tensor) -> None:
        buffer.copy_(data)
        buffer[3] ^= 0xFF  # a byte flipped on the way

    with pytest.raises(IntegrityError, match="fails its checksum"):
        copy.receive(header, torn, step="step-1")
    assert copy.steps() == {}  # nothing committed
    copy.receive(header, lambda buffer: buffer.copy_(data), step="step-1")
    restored = _state(0)
    copy.load("step-1", restored)
    assert torch.equal(restored["w"], torch.full((256,), 1.0)) and restored["n"] == 1
    with pytest.raises(IntegrityError, match="rank 0's step-1"):
        copy.receive(header, lambda buffer: None, step="step-2")
    mine.close()
    copy.close()


def test_replication_without_a_memory_tier_or_without_other_nodes_is_refused(tmp_path):
    from dcp_tiered import CheckpointManager

    with pytest.raises(ConfigError, match="needs memory="):
        CheckpointManager(local=tmp_path / "a", replication=Replication())
    with pytest.raises(ConfigError, match="several nodes"):
        CheckpointManager(
            local=tmp_path / "b", memory=tmp_path / "m", replication=Replication(), events=None
        )
