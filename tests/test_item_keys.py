"""policy.item_keys: a data file's item keys as a rank sends them to the coordinator, packed
or as tuples, the same keys either way."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dcp_tiered.policy.item_keys import ItemKeys, _from_packed

_keys = st.lists(
    st.tuples(
        st.text(min_size=1, max_size=12),
        st.none() | st.lists(st.integers(0, 2**62), max_size=4).map(tuple),
        st.none() | st.integers(0, 2**40),
    ),
    max_size=30,
)


@given(_keys)
def test_packed_keys_unpickle_to_the_same_keys(keys):
    packed, plain = ItemKeys.packed(keys), ItemKeys(keys)
    for sent in (packed, plain):
        got = pickle.loads(pickle.dumps(sent))
        assert list(got) == keys and len(got) == len(keys)
        assert got == packed and got == plain and packed == got
    assert pickle.loads(pickle.dumps(packed))._tuples is None  # not unpacked to compare


def test_keys_differ_where_any_part_differs():
    keys = [("a", (0, 0), 0), ("b", None, None), ("c", (4,), 2)]
    base = pickle.loads(pickle.dumps(ItemKeys.packed(keys)))
    for k, changed in enumerate([("a", (0, 1), 0), ("b", (), None), ("c", (4,), None)]):
        other = list(keys)
        other[k] = changed
        for make in (ItemKeys.packed, ItemKeys):
            assert pickle.loads(pickle.dumps(make(other))) != base, changed
    assert ItemKeys(keys)[2] == ("c", (4,), 2) and ItemKeys(keys)[:1] == [keys[0]]


def test_negative_numbers_are_sent_as_tuples_not_packed_as_none():
    keys = [("a", (0,), -3)]
    sent = ItemKeys.packed(keys)
    assert sent._packed is None
    assert list(pickle.loads(pickle.dumps(sent))) == keys


@pytest.mark.parametrize(
    "fqns, numbers",
    [
        (["a", "b"], [1, 0, -1]),  # b's numbers missing
        (["a"], [1, 0, -1, 7]),  # a number left over
        (["a"], [5, 0, -1]),  # an offset longer than the numbers
    ],
)
def test_packed_keys_that_do_not_add_up_are_refused(fqns, numbers):
    from array import array

    keys = _from_packed(fqns, array("q", numbers).tobytes())
    with pytest.raises(ValueError, match="packed item keys"):
        list(keys)
    with pytest.raises(ValueError, match="malformed"):
        _from_packed(fqns, b"\x00" * 7)
