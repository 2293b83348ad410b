"""The refusal of a save that would never restore: a value that ``weights_only`` loading
refuses is found before anything is written, and every rank raises the same ConfigError.

For adapters that check more than :meth:`~dcp_tiered.lifecycle.Lifecycle.require_restorable`'s
values (megatron-core's ``common.pt``, written by mcore itself): they say why their rank's
state would not load back, and :func:`refuse_unrestorable` agrees on it and words the
refusal."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..agreement import Agreement
from ..errors import ConfigError
from ..policy.memory_format import first_refused, refused_saved

__all__ = ["refuse_unrestorable", "unrestorable", "unrestorable_error", "unrestorable_file"]


def unrestorable(values: Any, trusted: Iterable[type] = ()) -> str | None:
    """Why a value of ``values`` (nested dicts/lists) would not load back with
    ``weights_only`` (``trusted`` classes allowed), naming its path and type; None: all would."""
    return first_refused(values, trusted)


def unrestorable_file(data: bytes) -> str | None:
    """Why the ``torch.save`` output ``data`` would not load with ``weights_only``; None: it would."""
    return refused_saved(data)


def refuse_unrestorable(agree: Agreement, checkpoint: str, why: str | None) -> None:
    """Collective: raises ConfigError on every rank when some rank's ``why`` says its state
    would not load back (``checkpoint`` names what was not saved)."""
    if not agree.any(why is not None):
        return
    raise unrestorable_error(checkpoint, agree.gather(why))


def unrestorable_error(checkpoint: str, whys: list[str | None]) -> ConfigError:
    """The refusal of ``checkpoint``, from every rank's ``why`` (at least one set): the one
    wording every entry point gives a state that would save and never restore."""
    rank, why = next((r, w) for r, w in enumerate(whys) if w)
    return ConfigError(
        f"{checkpoint} was not saved: on rank {rank}, {why}, so it could never be restored. "
        "Keep tensors, numbers, strings, lists and dicts in the state, or pass "
        "allow_pickle=True only for checkpoints you trust (non-tensor values then load with "
        "full pickle, which can run code)."
    )
