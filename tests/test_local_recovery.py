"""The sweep a save starts with (tiers/local_recovery) against leftovers still in use.

The race CI met: a save fails after its early uploads started; the next save's sweep removed the
failed save's upload area while an upload thread still wrote records into it, ``rmtree`` raised
ENOTEMPTY, and the next save failed with it. A sweep is housekeeping: what it cannot remove now
waits for the next one, and an upload area whose lock an upload holds is not removed at all.
"""

from __future__ import annotations

import logging
import threading

from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.policy import layout
from dcp_tiered.tiers.local import LocalTier

AREA = layout.upload_area_name("step-4", "abcdef012345")  # its save's tmp dir is gone


def test_a_sweep_never_fails_while_an_upload_writes_into_an_abandoned_area(tmp_path, caplog):
    tier = LocalTier(LocalBackend(str(tmp_path)))
    stop = threading.Event()

    def upload_records() -> None:  # what an early upload of the failed save does, in a loop
        backend, i = tier.backend, 0
        while not stop.is_set():
            try:
                backend.make_dir(AREA)
                backend.write_file(AREA, f"data-{i % 64}.done", b"{}", sync=False)
            except OSError:
                pass  # the sweep removed the area under it
            i += 1

    thread = threading.Thread(target=upload_records)
    thread.start()
    try:
        with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
            for _ in range(1500):
                tier.recover_and_sweep()  # raised ENOTEMPTY now and then before the fix
    finally:
        stop.set()
        thread.join()
    tier.recover_and_sweep()  # nothing writes now: the leftover goes
    assert AREA not in tier.backend.list_names()


def test_an_upload_area_whose_lock_is_held_is_kept(tmp_path):
    tier = LocalTier(LocalBackend(str(tmp_path)))
    backend = tier.backend
    backend.make_dir(AREA)
    fd = backend.lock_exclusive(AREA, "data-0.lock")  # an upload in flight
    try:
        tier.recover_and_sweep()
        assert AREA in backend.list_names()
    finally:
        backend.unlock(fd)
    tier.recover_and_sweep()  # the upload ended: its save is gone, so are its records
    assert AREA not in backend.list_names()
