"""policy.flatten: DCP's flattening of a state in one pass. DCP's own functions are the oracle,
on generated states of every shape DCP walks (nested mappings, lists that it expands or keeps
whole, tuples, values of any kind, keys that collide once joined), and through both planners."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner_helpers import _init_state_dict

from dcp_tiered import TieredLoadPlanner, TieredSavePlanner
from dcp_tiered.policy import flatten


class Tagged(list):  # a list subclass: DCP walks it as a list
    pass


class KeysSorted(dict):  # a dict whose keys iterate in another order than its items()
    def __iter__(self):
        return iter(sorted(dict.__iter__(self), key=str))


leaves = st.one_of(
    st.integers(-3, 3),
    st.floats(allow_nan=False, width=16),
    st.text("ab", max_size=2),
    st.none(),
    st.booleans(),
    st.binary(max_size=2),
    st.builds(lambda n: torch.arange(float(n)), st.integers(0, 3)),
    st.builds(lambda n: torch.nn.Parameter(torch.ones(n)), st.integers(1, 2)),
    st.tuples(st.integers(0, 2), st.builds(torch.zeros, st.just(1))),
)
keys = st.one_of(st.sampled_from(["a", "b", "a.b", "0", "c.0"]), st.integers(0, 2))
states = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.dictionaries(keys, inner, max_size=3),
        st.dictionaries(keys, inner, max_size=3).map(collections.OrderedDict),
        st.dictionaries(keys, inner, max_size=3).map(KeysSorted),
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=2).map(Tagged),
    ),
    max_leaves=12,
)


def _dcp_save_flatten(state):
    flat, paths = flatten_state_dict(state)
    return _flatten_sharded_tensors(flat), paths


def _same(ours, theirs, *, identical=True):
    (flat, paths), (want_flat, want_paths) = ours, theirs
    assert list(flat) == list(want_flat)  # the same keys in the same order
    for k, v in flat.items():  # the very values (``identical``: or, but for tensors, equal)
        assert v is want_flat[k] or not (identical or isinstance(v, torch.Tensor))
        assert type(v) is type(want_flat[k]) and (isinstance(v, torch.Tensor) or v == want_flat[k])
    assert paths == want_paths and all(type(p) is tuple for p in paths.values())
    assert [tuple(map(type, p)) for p in paths.values()] == [
        tuple(map(type, p)) for p in want_paths.values()
    ]  # ints stay ints (list indices), keys strings


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, states, max_size=4))
def test_flatten_is_dcps_save_and_load_walk_or_gives_up(state):
    """Where it gives up, the planners run DCP's own walk; where it does not, its result is
    both of DCP's: the save's and the load's (sharded tensors first), which differ for some
    states (0 and "0" in one dict, a list element without values)."""
    ours = flatten.flatten(state)
    if ours is None:
        return
    _same(ours, _dcp_save_flatten(state))
    _same(ours, flatten_state_dict(_flatten_sharded_tensors(state)))


class Box:  # a value DCP's load set-up does not know: its walk puts None in its place
    def __eq__(self, other):
        return isinstance(other, Box)


load_states = st.recursive(
    st.one_of(leaves, st.just(Box())),
    lambda inner: st.one_of(
        st.dictionaries(keys, inner, max_size=3),
        st.dictionaries(keys, inner, max_size=2).map(types.MappingProxyType),
        st.lists(inner, max_size=3),
    ),
    max_leaves=10,
)


def _rebuilt_of(old, new) -> bool:
    """``new`` is ``old``, or a list or tuple rebuilt of the same elements (at any depth)."""
    if new is old:
        return True
    return (
        type(old) in (list, tuple)
        and type(new) is type(old)
        and len(new) == len(old)
        and all(map(_rebuilt_of, old, new))
    )


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(keys, load_states, max_size=4))
def test_flatten_for_load_knows_what_dcps_load_set_up_leaves_as_it_is(state):
    """Where it says DCP's load set-up (``_init_state_dict``) leaves the state as it is,
    the state flattened after that set-up holds the very same values (a list or tuple: a
    copy of the same elements) under the same keys and paths. (Where it says not, the set-up may still leave
    it: a tuple in a list, rebuilt equal; the planner then runs DCP's set-up.)"""
    found = flatten.flatten_for_load(state)
    if found is None:
        return
    flat, paths, as_is = found
    assert (flat, paths) == flatten.flatten(state)
    snapshot = dict(flat)
    _init_state_dict(state)  # DCP's, in place (no meta tensor here: no process group needed)
    after = flatten.flatten(state)
    changed = after is None or list(after[0]) != list(snapshot) or after[1] != paths
    if not changed:
        for k, v in snapshot.items():
            if not _rebuilt_of(v, after[0][k]):
                changed = True
    assert not (as_is and changed), (snapshot, after)


def test_flatten_for_load_names_what_dcps_load_set_up_replaces():
    """Meta tensors (made real), values it does not know and Mappings that are not dicts
    (None put in their place): none is left as it is; a model's and optimizer's state is."""
    meta = {"a": {"w": torch.empty(3, device="meta")}, "b": torch.ones(2)}
    for state in (meta, {"a": {"b": Box()}}, {"a": types.MappingProxyType({"w": torch.ones(1)})}):
        assert flatten.flatten_for_load(state)[2] is False, state
    for state in ({"a": {"b": Box()}}, {"a": types.MappingProxyType({"w": torch.ones(1)})}):
        _init_state_dict(state)
        assert state["a"] is None or state["a"]["b"] is None  # what DCP's set-up does
    assert flatten.flatten_for_load(_model_state())[2] is True
    assert flatten.flatten_for_load({"a": {"w": torch.ones(3)}, "b": [1, "x"]})[2] is True


def test_it_gives_up_on_a_duplicate_key_and_on_what_dcps_walks_disagree_on():
    assert flatten.flatten({"a.b": 1, "a": {"b": 2}}) is None  # DCP raises its error
    assert flatten.flatten({0: 1, "0": {"a": 2}}) is None
    assert flatten.flatten({"a": [{}, torch.ones(1)]}) is None
    assert flatten.flatten(_model_state()) is not None  # what states are made of


def _model_state():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": 3}}


def test_both_planners_set_up_exactly_as_dcps():
    """An optimizer's state (param_groups: a list of dicts, params: a list of ints) through
    the planners themselves, against DCP's default planners."""
    state = _model_state()
    ours, theirs = TieredSavePlanner(), DefaultSavePlanner()
    for p in (ours, theirs):
        p.set_up_planner(state, None, True)
    _same((ours.state_dict, ours.mappings), (theirs.state_dict, theirs.mappings))
    assert ours.flatten_state_dict and ours.flatten_sharded_tensors  # restored
    assert ours.create_local_plan().items == theirs.create_local_plan().items

    mine, dcps = TieredLoadPlanner(), DefaultLoadPlanner()
    for p in (mine, dcps):
        p.set_up_planner(state, None, False)
    # each load's set-up rebuilds the state's lists and tuples in place (DCP's
    # _init_state_dict), so those are equal, not the same objects
    _same((mine.state_dict, mine.mappings), (dcps.state_dict, dcps.mappings), identical=False)
    assert mine.original_state_dict is state and dcps.original_state_dict is state
    assert mine.flatten_state_dict and mine.flatten_sharded_tensors


@pytest.mark.parametrize("planner", [TieredSavePlanner, TieredLoadPlanner])
def test_a_state_it_gives_up_on_gets_dcps_own_error(planner):
    state = {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}
    with pytest.raises(ValueError, match="duplicated flatten key"):
        planner().set_up_planner(state, None, True)
