"""The Megatron facade's restore: the newest iteration that verifies, from memory, storage or
the remote tier, falling back to older ones (the lifecycle's restore decides; this translates
Megatron's state)."""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.utils import extract_sharded_base

from ...errors import ConfigError
from ...lifecycle import Lifecycle, attempt
from ...lifecycle.memory import MemorySnapshots
from ...lifecycle.roots import MEGATRON, local_tier, numbered_steps, remote_backend
from .._common import is_node_leader
from .load import load as load_through_tiers
from .sidecars import remove_sidecars, write_sidecars
from .state import apply_state, iteration_dir, local_parts, state_dict, uid

logger = logging.getLogger(__package__)  # one logger per adapter, as before its split


class Restoring:
    """:class:`~dcp_tiered.shims.megatron.EasyCkpt`'s loading half."""

    lifecycle: Lifecycle
    memory: MemorySnapshots | None
    save_dir: str
    load_dir: str
    remote: Any
    storage_options: dict[str, Any] | None
    storage_every: int
    allow_pickle: bool

    if TYPE_CHECKING:

        def save_storage(
            self, iteration: int, model: Any, optimizer: Any, opt_param_scheduler: Any
        ) -> None: ...

    def load_checkpoint(
        self,
        model: Any,
        optimizer: Any,
        opt_param_scheduler: Any,
        load_arg: str = "load",
        strict: bool = True,
        concat: bool = False,
        on_unreadable_tier: str = "raise",
    ) -> int:
        """Restores the newest iteration that verifies; returns it (0: every tier was read and
        holds none). A remote tier that cannot be read raises TierUnavailableError on every rank
        (``on_unreadable_tier="skip"``: restore from the other tiers, with an ERROR log)."""
        if concat:
            raise ConfigError("concat=True is not supported: checkpoints reshard on load")
        root = {"load": self.load_dir, "save": self.save_dir}.get(load_arg)
        if root is None:
            raise ConfigError(f"load_arg must be 'load' or 'save', got {load_arg!r}")
        loaded: dict[tuple[int, str], Any] = {}
        if self.memory is not None:  # with replication: what every rank holds, for the loads
            self.memory.survey()

        def load(candidate: tuple[int, str]) -> str | None:
            iteration, tier = candidate
            if tier == "memory":
                state, problem = self._load_memory(iteration, model, optimizer, opt_param_scheduler)
            else:
                state, problem = self._load_storage(
                    root, iteration, model, optimizer, opt_param_scheduler
                )
            loaded[candidate] = state
            return problem

        chosen = self.lifecycle.restore(
            lambda with_remote: self._candidates(root, with_remote),
            load,
            on_unreadable_tier=on_unreadable_tier,
            retry="load_checkpoint",
            name=lambda c: f"{iteration_dir(c[0])} from {c[1]}",
            abandon=functools.partial(self._abandon, root),
        )
        if chosen is None:
            self._report_lost(-1, None)
            logger.info("easyckpt: nothing to restore in %s", root)
            return 0
        iteration, tier = chosen
        self._report_lost(iteration, f"{iteration_dir(iteration)} from {tier}")
        apply_state(loaded[chosen], model, optimizer, opt_param_scheduler, strict=strict)
        logger.info("easyckpt: restored iteration %d from %s", iteration, tier)
        if tier == "memory" and self.storage_every:
            self.save_storage(iteration, model, optimizer, opt_param_scheduler)
        return iteration

    def _abandon(
        self,
        root: str,
        proven: list[tuple[int, str]],
        passed: list[tuple[int, str]],
        chosen: tuple[int, str],
    ) -> None:
        """After a restore fell back to ``chosen``: the newer iterations of this save
        directory some rank proved bad quarantined, the others it passed over kept until
        saved again (see :meth:`~dcp_tiered.lifecycle.Lifecycle.pass_over`)."""

        def newer(failed: list[tuple[int, str]]) -> list[str]:
            if root != self.save_dir:
                return []
            return sorted({iteration_dir(i) for i, t in failed if t == "storage" and i > chosen[0]})

        reason = f"a restore fell back past it to {iteration_dir(chosen[0])}"
        self.lifecycle.quarantine(root, newer(proven), reason=reason)
        self.lifecycle.pass_over(root, newer(passed))

    def _candidates(self, root: str, with_remote: bool) -> list[tuple[int, str]]:
        """(iteration, tier): newest first, memory before storage for the same iteration."""
        found = {(n, "memory") for n in (self.memory.numbers() if self.memory else [])}
        # Listing only: a writer on the load directory would sweep it and resume its uploads.
        remote = remote_backend(self.remote, self.storage_options) if with_remote else None
        for n, _ in numbered_steps(root, remote, MEGATRON, strict=True):
            found.add((n, "storage"))
        return sorted(found, key=lambda c: (-c[0], c[1] != "memory"))

    def _load_memory(
        self, iteration: int, model: Any, optimizer: Any, scheduler: Any
    ) -> tuple[Any, str | None]:
        """This rank's snapshot of ``iteration`` as Megatron's state, or (None, why not). With
        replication it is collective, and a rank without a valid copy of its own loads a
        partner's."""
        memory = self.memory
        assert memory is not None

        def prepare() -> tuple[Any, Any, Any, dict[str, Any]]:
            sharded, nonpersistent, factories = load_preprocess(
                state_dict(iteration, model, optimizer, scheduler, is_loading=True)
            )
            sharded, common = extract_sharded_base(sharded)
            tensors, objects = local_parts(sharded)
            template = {
                "tensors": {k: t.clone() for k, t in tensors.items()},
                "objects": dict(objects),
                "common": common,
            }
            return sharded, nonpersistent, factories, template

        prepared, problem = attempt(prepare)
        if memory.replicating and self.lifecycle.agree.any(problem is not None):
            return None, problem or "failed on another rank"  # before the collective load
        if problem is not None:
            return None, problem
        sharded, nonpersistent, factories, template = prepared
        # Anything else raised here is a failure like the tier's own: ranks agree and move on.
        why, problem = attempt(memory.load, iteration_dir(iteration), template)
        if (problem or why) is not None:
            return None, problem or why

        def value(sh: Any) -> Any:
            if isinstance(sh, ShardedTensor):
                return template["tensors"][uid(sh)]
            if isinstance(sh, ShardedObject):
                return template["objects"][sh.unique_key]
            return sh

        def assemble() -> Any:
            dict_list_map_inplace(value, sharded)
            merge(template["common"], nonpersistent)  # what the save left out (param ids)
            merge(template["common"], sharded)
            return apply_factory_merges(template["common"], factories)

        return attempt(assemble)

    def _load_storage(
        self, root: str, iteration: int, model: Any, optimizer: Any, scheduler: Any
    ) -> tuple[Any, str | None]:
        """Collective. The state is read through the tiers (:func:`~dcp_tiered.shims.megatron.load.load`, common
        state included); ``metadata.json`` and ``common.pt`` are written into the directory
        from the step's verified data first, one writer a node, so that stock mcore and
        Megatron-LM can load a committed step too."""
        step = iteration_dir(iteration)
        agree = self.lifecycle.agree
        leader = is_node_leader()
        _, problem = (
            attempt(
                write_sidecars,
                root,
                step,
                remote=self.remote,
                storage_options=self.storage_options,
                allow_pickle=self.allow_pickle,
            )
            if leader
            else (None, None)
        )
        if not agree.all(problem is None):
            return None, problem or "failed on another rank"
        loaded, problem = attempt(
            load_through_tiers,
            state_dict(iteration, model, optimizer, scheduler, is_loading=True),
            os.path.join(root, step),
            remote=self.remote,
            storage_options=self.storage_options,
            allow_pickle=self.allow_pickle,
        )
        agree.barrier()
        if leader and not local_tier(root).has_step(step):
            remove_sidecars(root, step)
        return loaded, problem

    def _report_lost(self, restored: int, what: str | None) -> None:
        if self.memory is not None:
            self.memory.report_lost(restored, what)
