"""Splits an arbitrary nested state (a framework's "file") into tensors plus a skeleton.

DCP stores tensors natively but flattens containers, turning int keys into strings, and stores
any other object as a pickle. Frameworks' files hold both (DeepSpeed: OrderedDicts keyed by
int, loss-scaler objects, enums). So each file becomes ``{"skeleton": bytes, "t0": tensor,
...}``: the skeleton is the original structure with every tensor replaced by a numbered
:class:`TensorSlot`, serialised with ``torch.save``.

Reading a skeleton back uses torch's ``weights_only`` unpickler, which builds only the classes
it is given, so bytes from storage never get to run code. No I/O here.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import IntegrityError

SKELETON_KEY = "skeleton"


@dataclass(frozen=True)
class TensorSlot:
    """Where tensor ``index`` of the file goes back in."""

    index: int


def tensor_key(index: int) -> str:
    return f"t{index}"


def split(obj: Any) -> dict[str, Any]:
    """``obj`` as ``{"skeleton": bytes, "t0": tensor, ...}`` (tensors in traversal order)."""
    tensors: list[torch.Tensor] = []

    def strip(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return TensorSlot(len(tensors) - 1)
        return value

    buf = io.BytesIO()
    torch.save(map_leaves(obj, strip), buf)
    return {SKELETON_KEY: buf.getvalue(), **{tensor_key(i): t for i, t in enumerate(tensors)}}


def join(
    parts: dict[str, Any], *, where: str, trusted: Iterable[type] = (), allow_pickle: bool = False
) -> Any:
    """The original object back from :func:`split`'s output.

    ``trusted``: the classes (beyond torch's own safe set) the skeleton may contain.
    ``allow_pickle``: any class, with full pickle (for checkpoints the caller trusts).
    """
    try:
        with torch.serialization.safe_globals([TensorSlot, *trusted]):
            skeleton = torch.load(io.BytesIO(parts[SKELETON_KEY]), weights_only=not allow_pickle)
    except (pickle.UnpicklingError, RuntimeError) as e:
        raise IntegrityError(
            f"the structure of {where} holds objects that are not on the list of trusted "
            f"classes ({e}). Add the classes to the trusted list if they are yours, or "
            "pass allow_pickle=True only for checkpoints you trust."
        ) from e

    def fill(value: Any) -> Any:
        if not isinstance(value, TensorSlot):
            return value
        try:
            return parts[tensor_key(value.index)]
        except KeyError:
            raise IntegrityError(
                f"{where} refers to tensor {value.index}, which the checkpoint lacks"
            ) from None

    return map_leaves(skeleton, fill)


def map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """A copy of ``value``'s dicts, lists and plain tuples with ``leaf`` applied to the rest."""
    if isinstance(value, dict):
        out: dict[Any, Any] = OrderedDict() if isinstance(value, OrderedDict) else {}
        for k, v in value.items():
            out[k] = map_leaves(v, leaf)
        return out
    if isinstance(value, list):
        return [map_leaves(v, leaf) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):  # namedtuples stay leaves
        return tuple(map_leaves(v, leaf) for v in value)
    return leaf(value)
