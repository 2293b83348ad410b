"""The keys of a data file's items, as a rank sends them to the coordinator. Pure: no I/O.

DCP pickles every rank's write results to the coordinator on every save. A data file's keys
as a list of ``(fqn, chunk offset, index)`` tuples cost about a microsecond an item each way
(20,000 tensors: 22 ms of every save on the coordinator). Packed, they are the fqns and one
``int64`` array: a save written from a kept layout sends the same packed keys every time,
and the coordinator, which only compares them with the last save's while the layout holds,
never unpacks them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

Key = tuple[str, tuple[int, ...] | None, int | None]


class ItemKeys(Sequence[Key]):
    """A data file's item keys in order: a sequence of ``(fqn, offset, index)`` tuples."""

    __slots__ = ("_packed", "_tuples")

    def __init__(self, keys: Iterable[Key]) -> None:
        self._tuples: list[Key] | None = list(keys)
        self._packed: tuple[list[str], bytes] | None = None

    @classmethod
    def packed(cls, keys: Iterable[Key]) -> ItemKeys:
        """Keys that are pickled packed (worth it for keys sent again and again); as they
        are where a number is negative (-1 stands for None when packed)."""
        out = cls(keys)
        assert out._tuples is not None
        numbers = array("q")
        for _, offset, index in out._tuples:
            if (index is not None and index < 0) or min(offset or (), default=0) < 0:
                return out  # -1 is None when packed: these go as tuples
            if offset is None:
                numbers.append(-1)
            else:
                numbers.append(len(offset))
                numbers.extend(offset)
            numbers.append(-1 if index is None else index)
        out._packed = ([fqn for fqn, _, _ in out._tuples], numbers.tobytes())
        return out

    def _unpacked(self) -> list[Key]:
        if self._tuples is None:
            assert self._packed is not None
            fqns, data = self._packed
            numbers = array("q")
            numbers.frombytes(data)
            keys: list[Key] = []
            at = 0
            try:
                for fqn in fqns:
                    n = numbers[at]
                    offset = None if n < 0 else tuple(numbers[at + 1 : at + 1 + n])
                    at += 1 + max(n, 0)
                    index = numbers[at]
                    keys.append((fqn, offset, None if index < 0 else index))
                    at += 1
            except IndexError:
                raise ValueError("packed item keys are shorter than their fqns") from None
            if at != len(numbers):
                raise ValueError("packed item keys are longer than their fqns")
            self._tuples = keys
        return self._tuples

    def __reduce__(self) -> tuple[Any, ...]:
        if self._packed is not None:
            return (_from_packed, self._packed)
        return (ItemKeys, (self._tuples,))

    def __len__(self) -> int:
        return len(self._packed[0]) if self._packed is not None else len(self._unpacked())

    @overload
    def __getitem__(self, k: int) -> Key: ...
    @overload
    def __getitem__(self, k: slice) -> list[Key]: ...
    def __getitem__(self, k: int | slice) -> Key | list[Key]:
        return self._unpacked()[k]

    def __iter__(self) -> Iterator[Key]:
        return iter(self._unpacked())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ItemKeys):
            return NotImplemented
        if self._packed is not None and other._packed is not None:
            return self._packed == other._packed
        return self._unpacked() == other._unpacked()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ItemKeys({len(self)} items)"


def _from_packed(fqns: list[str], data: bytes) -> ItemKeys:
    if not isinstance(fqns, list) or not isinstance(data, bytes) or len(data) % 8:
        raise ValueError("malformed packed item keys")
    out = ItemKeys.__new__(ItemKeys)
    out._tuples = None
    out._packed = (fqns, data)
    return out
