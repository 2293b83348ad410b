"""Restore's agreement: try candidates newest first on every rank, fall back past a step that
fails on any rank, and tell a step proven bad from one a tier could not be read for."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch.distributed.checkpoint.api import CheckpointException

from .._torch_compat import global_rank
from ..agreement import Agreement
from ..backends.local import LocalBackend
from ..backends.remote import RemoteBackend, remote_backend
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    ForeignPathError,
    IntegrityError,
    TierError,
    TierUnavailableError,
    causes,
    describe,
)
from ..tiers.local import LocalTier
from ..tiers.remote import RemoteTier
from .writers import Writers

logger = logging.getLogger("dcp_tiered.lifecycle")  # the name its records always had

C = TypeVar("C")

CORRUPT, UNREADABLE, MISMATCH, OTHER = "corrupt", "unreadable", "mismatch", "other"


class LoadFailure(str):
    """Why a candidate failed to load (the text), and what kind of failure it was: ``corrupt``
    (proof the step is bad: ``IntegrityError.proves_bad``), ``unreadable`` (a tier could not be
    read now), ``mismatch`` (a ConfigError: the state being loaded does not fit the step) or
    ``other``."""

    kind: str = OTHER

    @classmethod
    def of(cls, error: BaseException, why: str) -> LoadFailure:
        failure = cls(why)
        failure.kind = kind_of(error)
        return failure


def kind_of(error: BaseException) -> str:
    """The kind of a load's failure (see :class:`LoadFailure`), from every rank's cause."""
    found = causes(error)
    if any(isinstance(c, (TierError, TimeoutError, ConnectionError)) for c in found):
        return UNREADABLE
    if any(isinstance(c, IntegrityError) and c.proves_bad for c in found):
        return CORRUPT
    if any(isinstance(c, ConfigError) for c in found):
        return MISMATCH
    return OTHER


def failure_kind(problem: str | None) -> str | None:
    return None if problem is None else getattr(problem, "kind", OTHER)


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, str | None]:
    """``(fn(...), None)``, or ``(None, why)`` if it raised (a :class:`LoadFailure`): ranks
    then agree on moving on."""
    rank = global_rank()
    try:
        return fn(*args, **kwargs), None
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's is a BaseException
        why = describe(e) if isinstance(e, CheckpointException) else f"rank {rank}: {describe(e)}"
        return None, LoadFailure.of(e, why)


def first_loadable(
    agree: Agreement,
    found: list[C],
    load: Callable[[C], str | None],
    *,
    on_unreadable_tier: str,
    retry: str,
    name: Callable[[C], str],
    abandon: Callable[[list[C], list[C], C], None] | None,
) -> C | None:
    """Collective: the first of ``found`` that ``load`` loads on every rank (see
    :meth:`~dcp_tiered.lifecycle.restore.Restoring.restore`)."""
    reasons: list[str] = []
    proven: list[C] = []
    passed: list[C] = []  # failed, not proven bad
    mismatched = True  # every candidate so far failed because the state does not fit it
    for candidate in found:
        problem = load(candidate)
        if not agree.any(problem is not None):
            if (proven or passed) and abandon is not None:
                abandon(proven, passed, candidate)
            return candidate
        kinds = {k for k in agree.gather(failure_kind(problem)) if k}
        problem = problem or "failed on another rank"
        reasons.append(f"{name(candidate)}: {problem}")
        mismatched = mismatched and kinds == {MISMATCH}
        if UNREADABLE in kinds and on_unreadable_tier == "raise":
            raise TierUnavailableError(
                f"{name(candidate)} could not be read now ({problem}); an older step is not "
                f"restored in its place while it may be fine. Restore again once the tier "
                f"answers, or call {retry}(..., on_unreadable_tier='skip') to restore an "
                "older step instead (nothing is quarantined for it)."
            )
        (proven if CORRUPT in kinds else passed).append(candidate)
        logger.warning(
            "cannot restore %s, trying an older step (%s): %s",
            name(candidate),
            "proven bad" if CORRUPT in kinds else "kept as it is: not proven bad",
            problem,
        )
    if reasons and mismatched:  # the steps are there: the state is not the one they hold
        raise ConfigError(
            "no step could be restored: the state being loaded, or the configuration, does not "
            "fit any of the steps (another model than the one saved?):\n  "
            + "\n  ".join(reasons)
            + "\nFix what each names (restore into the state the steps were saved from), or "
            "point the manager at another root to start without them."
        )
    if reasons:
        raise CheckpointNotFoundError(
            "no step could be restored; every candidate failed:\n  " + "\n  ".join(reasons)
        )
    return None


def listed(
    agree: Agreement,
    candidates: Callable[[bool], list[C]],
    *,
    on_unreadable_tier: str,
    retry: str,
) -> list[C]:
    """Collective: the candidates rank 0 lists, on every rank (see
    :meth:`~dcp_tiered.lifecycle.restore.Restoring.restore`)."""
    if on_unreadable_tier not in ("raise", "skip"):
        raise ConfigError(
            f"on_unreadable_tier must be 'raise' or 'skip', not {on_unreadable_tier!r}"
        )

    def listing() -> tuple[list[C], str | None]:
        try:
            return candidates(True), None
        except TierUnavailableError as e:
            return (candidates(False) if on_unreadable_tier == "skip" else []), str(e)

    found, unreadable = agree.from_rank0(listing)
    if unreadable is not None:
        if on_unreadable_tier == "raise":
            raise TierUnavailableError(
                f"{unreadable}. To restore from the tiers that can be read instead, call "
                f"{retry}(..., on_unreadable_tier='skip')."
            )
        logger.error("%s; restoring from the other tiers (on_unreadable_tier='skip')", unreadable)
    return found


def quarantine(
    agree: Agreement,
    root: str,
    steps: list[str],
    *,
    reason: str,
    run_id: str | None,
    remote: RemoteBackend | None,
) -> None:
    """Collective: ``steps`` moved aside on every node's ``root`` and on ``remote`` (see
    :meth:`~dcp_tiered.lifecycle.Lifecycle.quarantine`)."""
    if not steps:
        return
    tier = LocalTier(LocalBackend(root))

    def each(act: Callable[[str], Any]) -> None:
        for step in steps:
            try:
                act(step)
            except ForeignPathError as e:
                logger.warning("not quarantining %s: %s", step, e)

    agree.by_node_leaders(
        lambda: each(lambda step: tier.quarantine(step, reason=reason, run_id=run_id)),
        f"quarantining {', '.join(steps)} in {root}",
    )
    if remote is not None:
        agree.from_rank0(
            lambda: each(
                lambda step: RemoteTier(remote).quarantine(step, reason=reason, run_id=run_id)
            )
        )


class Restoring:
    """Restore and quarantine, the part of :class:`~dcp_tiered.lifecycle.Lifecycle` (a base
    class of it) that reads checkpoints back."""

    agree: Agreement
    writers: Writers
    run_id: str | None
    listed: list[Any]
    passed_over: set[tuple[str, str]]

    def restore(
        self,
        candidates: Callable[[bool], list[C]],
        load: Callable[[C], str | None],
        *,
        on_unreadable_tier: str,
        retry: str,
        name: Callable[[C], str] = str,
        abandon: Callable[[list[C], list[C], C], None] | None = None,
    ) -> C | None:
        """Collective: the first candidate ``load`` loads on every rank, or None if there
        are none.

        ``candidates(with_remote)`` lists them newest first (rank 0 alone; every rank tries
        the same ones); it raises TierUnavailableError when the remote cannot be read, which
        is raised on every rank unless ``on_unreadable_tier="skip"``. ``load`` returns
        None or why it failed (a :class:`LoadFailure`, as :func:`attempt` makes, says what
        kind of failure); ranks agree, so one rank's failure moves all to the next. A candidate
        a tier could not be read for (a transient error, a timeout) raises TierUnavailableError
        on every rank, like an unreadable listing, unless ``on_unreadable_tier="skip"``: a
        newer step may be fine. ``retry`` is the call that skips an unreadable tier, for the
        message. After falling back, ``abandon(proven, passed, chosen)`` runs on every rank with
        the candidates some rank proved bad (``IntegrityError.proves_bad``; see
        :meth:`quarantine`) and those that failed otherwise (kept as they are)."""
        found = listed(self.agree, candidates, on_unreadable_tier=on_unreadable_tier, retry=retry)
        self.listed = found
        return first_loadable(
            self.agree,
            found,
            load,
            on_unreadable_tier=on_unreadable_tier,
            retry=retry,
            name=name,
            abandon=abandon,
        )

    def pass_over(self, root: str, steps: Iterable[str]) -> None:
        """``steps`` under ``root``, newer than the one a restore chose, failed to load but
        nothing proved them bad: they stay as they are, listed and loadable, until this
        process saves one of them again (training going on from the older step), which then
        moves it aside (:meth:`move_aside_passed_over`) rather than replace it."""
        self.passed_over.update((os.path.abspath(root), step) for step in steps)

    def move_aside_passed_over(self, root: str, step: str) -> None:
        """Collective (every rank saves the same step, and restored alike): before a save of
        ``step``, quarantine it if a restore passed over it (:meth:`pass_over`)."""
        key = (os.path.abspath(root), step)
        if key in self.passed_over:
            self.passed_over.discard(key)
            reason = "a restore fell back past it (not proven bad) and training saves it again"
            self.quarantine(root, [step], reason=reason)

    def quarantine(self, root: str, steps: list[str], *, reason: str) -> None:
        """Collective: move ``steps`` (proven bad) aside on every node's ``root`` (one process a
        node) and on the remote tier (rank 0), under names of ours, logged, never deleted, and
        only where they are this run's (another run's step is left as it is, with a WARNING).
        Training that restored an older step saves those step names again; ``latest``,
        retention and the remote's never-overwrite rule then see only the new saves.
        ``dcp-tiered quarantine --release`` undoes it."""
        remote = remote_backend(self.writers.remote, self.writers.storage_options)
        quarantine(self.agree, root, steps, reason=reason, run_id=self.run_id, remote=remote)
