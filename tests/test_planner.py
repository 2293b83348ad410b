"""TieredSavePlanner: DCP's default planner's plans, metadata and errors, with a global check
that is one pass for grid-sharded tensors. DCP's own ``_validate_global_plan`` is the oracle."""

from __future__ import annotations

import collections
import dataclasses
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    _validate_global_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from dcp_tiered import TieredSavePlanner, TieredStorageWriter
from dcp_tiered.planner import planner_for
from dcp_tiered.policy.chunk_grid import plan_errors, tiles_as_grid
from tests.conftest import counted_calls

PROPS = TensorProperties(dtype=torch.float32)


def _shard(fqn, size, offsets, sizes):
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=PROPS,
            size=torch.Size(size),
        ),
    )


def _plans(world: int, extra=()) -> list[SavePlan]:
    """Each rank's plan of a small model: FSDP (dim 0) shards of tensors whose longest
    dimension is dim 0 and of ones whose longest is dim 1 (DCP's quadratic case), a 2 x 2
    grid over 4 ranks, a replicated tensor every rank writes (deduplicated), a bytes item."""
    plans = []
    for r in range(world):
        items = [
            _shard("w1", (8 * world, 4), (8 * r, 0), (8, 4)),
            _shard("w2", (2 * world, 64), (2 * r, 0), (2, 64)),
            _shard("norm", (16,), (0,), (16,)),
            WriteItem(index=MetadataIndex(f"extra_{r}"), type=WriteItemType.BYTE_IO),
        ]
        if r < 4:
            row, col = divmod(r, 2)
            items.append(_shard("tp", (6, 10), (3 * row, 5 * col), (3, 5)))
        items.extend(item for rank, item in extra if rank == r)
        plans.append(SavePlan(items, planner_data={}))
    return plans


def _global(planner_cls, plans):
    planner = planner_cls()
    planner.set_up_planner({}, None, True)
    return planner.create_global_plan(plans)


@pytest.mark.parametrize("world", [1, 4, 16])
def test_the_same_global_plans_and_metadata_as_dcps_default_planner(world):
    ours_plans, ours_md = _global(TieredSavePlanner, _plans(world))
    dcp_plans, dcp_md = _global(DefaultSavePlanner, _plans(world))
    assert ours_plans == dcp_plans
    assert ours_md == dcp_md
    assert len(ours_md.state_dict_metadata["w2"].chunks) == world  # the plans were real


@pytest.mark.parametrize(
    "extra, why",
    [
        ([(1, _shard("w1", (32, 4), (4, 0), (8, 4)))], "overlapping chunks"),  # over rank 0/1
        ([(2, _shard("tp", (6, 10), (3, 8), (3, 5)))], "out of bounds chunk"),
        ([(3, _shard("gap", (9,), (0,), (4,)))], "invalid fill"),  # 5 elements nobody writes
    ],
)
def test_a_bad_global_plan_is_refused_in_dcps_words(extra, why):
    with pytest.raises(ValueError) as dcp_error:
        _global(DefaultSavePlanner, _plans(4, extra))
    with pytest.raises(ValueError) as ours:
        _global(TieredSavePlanner, _plans(4, extra))
    assert why in str(ours.value)
    assert str(ours.value) == str(dcp_error.value) or _same_findings(
        str(ours.value), str(dcp_error.value)
    )


def _same_findings(a: str, b: str) -> bool:
    return _findings(a.split(": ", 1)[1].split("; ")) == _findings(b.split(": ", 1)[1].split("; "))


def _findings(errors: list[str]) -> collections.Counter:
    """Errors as comparable facts: an overlap is an unordered pair of chunks (the two checks
    may meet a pair in either order)."""
    out: collections.Counter = collections.Counter()
    for e in errors:
        m = re.fullmatch(
            r"(key:\S+ has overlapping chunks:) (ChunkStorage.*\)) (ChunkStorage.*)", e
        )
        out[(m.group(1), frozenset((m.group(2), m.group(3)))) if m else e] += 1
    return out


boxes = st.lists(
    st.tuples(st.integers(-1, 6), st.integers(0, 7), st.integers(0, 5), st.integers(0, 6)),
    min_size=1,
    max_size=9,
)


@settings(max_examples=300, deadline=None)
@given(st.tuples(st.integers(1, 8), st.integers(1, 8)), boxes, st.integers(1, 3))
def test_the_check_finds_what_dcps_finds(size, chunks, plans):
    """Any chunk list (overlapping, out of bounds, gaps, empty, grids): the same errors."""
    chunk_md = [ChunkStorageMetadata(torch.Size(c[:2]), torch.Size(c[2:])) for c in chunks]
    md = Metadata({"t": TensorStorageMetadata(PROPS, torch.Size(size), chunk_md)})
    assert _findings(plan_errors(md, plans)) == _findings(
        _validate_global_plan([SavePlan([])] * plans, md)
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.lists(st.integers(1, 4), max_size=4))
def test_a_grid_is_recognised_in_any_order_and_a_missing_or_doubled_cell_is_not(rows, cols):
    size = (sum(rows), sum(cols) or 1)
    cols = cols or [1]
    cells = [
        ((sum(rows[:i]), sum(cols[:j])), (rows[i], cols[j]))
        for i in range(len(rows))
        for j in range(len(cols))
    ]
    assert tiles_as_grid(size, cells[::-1])
    if len(cells) > 1:
        assert not tiles_as_grid(size, cells[1:])
        assert not tiles_as_grid(size, [*cells[1:], cells[-1]])


def test_both_planners_flatten_the_state_with_the_collector_paused(monkeypatch, tmp_path):
    """DCP's flattening makes objects per item while the load's manifest (or the save's
    plans) are alive: a full collection there walks them all (a quarter of a 20,000-tensor
    restore's CPU). Both planners run it paused, and leave the collector as they found it."""
    import gc
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import default_planner

    from dcp_tiered import TieredLoadPlanner, TieredStorageReader, TieredStorageWriter
    from dcp_tiered.policy import flatten as one_pass

    seen = []

    def spied(module, name):
        original = getattr(module, name)

        def flatten(state):
            seen.append(gc.isenabled())
            return original(state)

        monkeypatch.setattr(module, name, flatten)

    spied(default_planner, "flatten_state_dict")  # DCP's, where the one pass gives up
    spied(one_pass, "flatten")  # the save's
    spied(one_pass, "flatten_for_load")  # the load's
    state = {"model": {f"w{i}": torch.full((4,), float(i)) for i in range(8)}}
    with TieredStorageWriter(tmp_path) as writer, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dcp.save(state, checkpoint_id="step-1", storage_writer=writer, planner=TieredSavePlanner())
    # DCP passes storage_meta and is_coordinator only to a signature that names them
    assert not [w for w in caught if "set_up_planner" in str(w.message)]
    target = {"model": {f"w{i}": torch.zeros(4) for i in range(8)}}
    dcp.load(
        target,
        checkpoint_id="step-1",
        storage_reader=TieredStorageReader(tmp_path),
        planner=TieredLoadPlanner(),
    )
    assert seen == [False, False]  # the save's flattening, then the load's
    assert gc.isenabled()
    assert torch.equal(target["model"]["w7"], state["model"]["w7"])


def test_resolve_data_gives_what_dcps_does_without_its_lookup_for_plain_tensors(monkeypatch):
    """A plain tensor saved whole comes straight from the flat state; every other item, and
    every item of a subclass that changes the lookup or the transform, goes DCP's way, with
    DCP's errors."""
    from torch.distributed.checkpoint import default_planner

    looked = []
    real = default_planner.find_state_dict_object
    monkeypatch.setattr(
        default_planner, "find_state_dict_object", lambda *a: looked.append(a[1].fqn) or real(*a)
    )
    state = {"w": torch.ones(2, 3), "p": torch.nn.Parameter(torch.zeros(4)), "n": 7}
    ours, dcps = TieredSavePlanner(), DefaultSavePlanner()
    for p in (ours, dcps):
        p.set_up_planner(state, None, True)
    items = ours.create_local_plan().items
    assert sorted(i.index.fqn for i in items) == ["n", "p", "w"]
    looked.clear()
    got = [ours.resolve_data(item) for item in items]
    assert looked == ["n"]  # only the bytes item went through DCP's lookup
    for item, mine in zip(items, got):
        want = dcps.resolve_data(item)
        if isinstance(want, torch.Tensor):
            assert mine is want
        else:
            assert mine.getvalue() == want.getvalue()
    looked.clear()
    shifted = dataclasses.replace(items[0], index=MetadataIndex("w", torch.Size([1, 0])))
    for p in (ours, dcps):
        with pytest.raises(ValueError, match="is not a ShardedTensor"):
            p.resolve_data(shifted)
    missing = dataclasses.replace(items[0], index=MetadataIndex("gone", torch.Size([0, 0])))
    with pytest.raises(ValueError, match="Could not find FQN"):
        ours.resolve_data(missing)

    class Halving(TieredSavePlanner):
        def transform_object(self, write_item, object):
            return object / 2 if isinstance(object, torch.Tensor) else object

    halving = Halving()
    halving.set_up_planner(state, None, True)
    w = next(i for i in items if i.index.fqn == "w")
    assert torch.equal(halving.resolve_data(w), torch.full((2, 3), 0.5))


def test_every_writer_plans_under_a_cache_key_of_its_own(tmp_path):
    """DCP's plan caches outlive a writer: a new writer whose id is a collected one's must
    not find that writer's cached plans under its key (they would be replayed to it)."""
    keys, ids = set(), set()
    for _ in range(20):
        with TieredStorageWriter(tmp_path) as writer:
            keys.add(planner_for(writer)._cached_plans_key)
            ids.add(id(writer))
        del writer
    assert len(keys) == 20
    assert len(ids) < 20  # ids were reused here: keys made of them would have repeated


def test_resolve_items_gives_each_items_resolve_data():
    """A data file's items resolved together are what ``resolve_data`` gives each one: the
    flat state's own tensors (looked up anew on every call: the item list's keys are kept,
    never its values), a bytes item serialised, and DCP's errors for a tensor that no longer
    fits its item."""
    state = {"w": torch.ones(2, 3), "p": torch.nn.Parameter(torch.zeros(4)), "v": torch.ones(5)}
    ours = TieredSavePlanner()
    ours.set_up_planner(state, None, True)
    items = ours.create_local_plan().items
    for attempt in range(2):  # the second call finds the list's keys kept
        got = ours.resolve_items(items)
        assert [g is state[i.index.fqn] for g, i in zip(got, items)] == [True] * 3, attempt
    state = {
        "w": torch.full((2, 3), 2.0),
        "p": torch.nn.Parameter(torch.ones(4)),
        "v": torch.ones(5),
    }
    ours.set_up_planner(state, None, True)
    assert [g is state[i.index.fqn] for g, i in zip(ours.resolve_items(items), items)] == [True] * 3

    mixed = {**state, "n": 7}
    ours.set_up_planner(mixed, None, True)
    items = ours.create_local_plan().items
    got = ours.resolve_items(items)
    for item, mine in zip(items, got):
        want = ours.resolve_data(item)
        assert (
            mine is want if isinstance(want, torch.Tensor) else mine.getvalue() == want.getvalue()
        )

    for changed, error in (
        ({"v": torch.ones(5, 1)}, "is not a ShardedTensor"),
        ({"v": None}, None),
    ):
        ours.set_up_planner({**mixed, **changed}, None, True)
        with pytest.raises((ValueError, TypeError, AttributeError)) as by_item:
            [ours.resolve_data(i) for i in items]
        with pytest.raises(type(by_item.value), match=error) as together:
            ours.resolve_items(items)
        assert str(together.value) == str(by_item.value)

    class Halving(TieredSavePlanner):
        def transform_object(self, write_item, object):
            return object / 2 if isinstance(object, torch.Tensor) else object

    halving = Halving()
    halving.set_up_planner(state, None, True)
    items = halving.create_local_plan().items
    halved = {i.index.fqn: t for i, t in zip(items, halving.resolve_items(items))}
    assert {k: float(t.detach().flatten()[0]) for k, t in halved.items()} == {
        "w": 1.0,
        "p": 0.5,
        "v": 0.5,
    }


def _local_items(planner, state, is_coordinator=True):
    planner.set_up_planner(state, None, is_coordinator)
    return planner.create_local_plan().items


def _pinned_if(flags):
    """``torch.Tensor.is_pinned`` answering from ``flags`` (a tensor's value 1 = pinned): no
    tensor can be pinned on a machine without an accelerator."""
    return lambda self, *a: bool(flags) and bool(self.flatten()[0] == 1)


@pytest.mark.parametrize(
    "change",
    [
        "shape",
        "dtype",
        "requires_grad",
        "layout",
        "order",
        "value class",
        "pinning",
        "coordinator",
        "none",
    ],
)
def test_a_kept_local_plan_is_reused_only_for_the_same_facts_of_every_tensor(
    change, monkeypatch, request
):
    """The kept plan is DCP's plan of the state again, or it is made afresh: any fact of a
    tensor that DCP's plan holds (size, dtype, layout, requires_grad, pinning), the keys'
    order, a value's class or the rank's being the coordinator changed makes a new one,
    equal to DCP's own."""
    from torch.distributed.checkpoint import default_planner

    from dcp_tiered import planner as planner_module

    pinned: list[int] = []
    monkeypatch.setattr(torch.Tensor, "is_pinned", _pinned_if(pinned))
    monkeypatch.setattr(planner_module, "_may_pin", lambda: True)  # as with an accelerator
    made = counted_calls(monkeypatch, default_planner, "create_default_local_save_plan")
    first = {"a": torch.zeros(4, 3), "b": torch.zeros(5), "n": 3}
    changed = {
        "shape": {**first, "b": torch.zeros(6)},
        "dtype": {**first, "b": torch.zeros(5, dtype=torch.float64)},
        "requires_grad": {**first, "b": torch.zeros(5).requires_grad_()},  # a Tensor still
        "layout": {**first, "a": torch.zeros(4, 3).to_sparse()},
        "order": {"b": first["b"], "a": first["a"], "n": 3},
        "value class": {**first, "n": 3.0},
        "pinning": {**first, "b": torch.ones(5)},  # "pinned" once pinning is on
        "coordinator": first,  # planned by a rank that is not the coordinator
        "none": {**first, "a": torch.ones(4, 3)},  # other values only
    }[change]
    key = f"test@{request.node.name}"
    _local_items(TieredSavePlanner(cache_key=key), first)
    if change == "pinning":
        pinned.append(1)
    coordinator = change != "coordinator"
    got = _local_items(TieredSavePlanner(cache_key=key), changed, coordinator)
    assert len(made) == (1 if change == "none" else 2)
    want = _local_items(DefaultSavePlanner(), changed, coordinator)
    assert got == want and [i.tensor_data for i in got] == [i.tensor_data for i in want]
    if change == "pinning":
        assert [i.tensor_data.properties.pin_memory for i in got if i.tensor_data] == [False, True]


def test_no_tensor_is_asked_whether_it_is_pinned_where_none_can_be(monkeypatch):
    """Without an accelerator (this build) nothing can be pinned, and the plan's structure does
    not ask each tensor; with one, it does."""
    from dcp_tiered import planner as planner_module

    asked = []
    real = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda t, *a: asked.append(1) or real(t, *a))
    state = {f"t{i}": torch.zeros(2) for i in range(5)}
    if torch.accelerator.current_accelerator() is None:
        with pytest.raises(RuntimeError):
            torch.zeros(2).pin_memory()
        assert not planner_module._may_pin()
        planner_module._structure(state, True)
        assert asked == []
    monkeypatch.setattr(planner_module, "_may_pin", lambda: True)
    planner_module._structure(state, True)
    assert len(asked) == 5
