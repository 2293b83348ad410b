"""An early upload reads its data file from the save's temporary directory; the local commit
renames that directory to the step, and can do so between any two of the upload's reads of the
file. The upload then reads it from the step: it is not deferred to the promotion (which is
what a CI run once showed: one of two early uploads missing). The rename is a real rename, made
before and after each of the upload's reads in turn."""

from __future__ import annotations

import os

import crc32c
import pytest

from dcp_tiered.backends.local import LocalBackend
from dcp_tiered.backends.remote import RemoteBackend
from dcp_tiered.config import RemoteConfig
from dcp_tiered.policy import integrity, layout
from dcp_tiered.tiers.file_upload import upload_locked
from dcp_tiered.tiers.local import LocalTier
from dcp_tiered.tiers.remote import RemoteTier

STEP, SAVE_ID, NAME = "step-3", "5eed", "__0_0.distcp"


class CommitsDuringTheUpload(LocalBackend):
    """A local root whose save is committed (its temporary directory renamed to the step)
    just before or just after the ``at``-th read of a file's checksum or size (after the
    second: before the upload opens the file)."""

    def __init__(self, root, at: int, after: bool) -> None:
        super().__init__(root)
        self.reads, self.at, self.after = 0, at, after

    def _commit(self) -> None:
        os.rename(self.path_of(layout.tmp_dir_name(STEP, SAVE_ID)), self.path_of(STEP))

    def _around(self, read, *parts):
        self.reads += 1
        if self.reads == self.at and not self.after:
            self._commit()
        got = read(*parts)
        if self.reads == self.at and self.after:
            self._commit()
        return got

    def file_checksum(self, *parts):
        return self._around(super().file_checksum, *parts)

    def file_size(self, *parts):
        return self._around(super().file_size, *parts)


@pytest.mark.parametrize("at", [1, 2])
@pytest.mark.parametrize("after", [False, True], ids=["before", "after"])
def test_a_commit_between_the_reads_of_an_early_upload_does_not_defer_it(tmp_path, at, after):
    data = os.urandom(3 * 2**20 + 7)
    backend = CommitsDuringTheUpload(tmp_path / "root", at, after)
    tmp = backend.path_of(layout.tmp_dir_name(STEP, SAVE_ID))
    os.makedirs(tmp)
    os.makedirs(backend.path_of(layout.upload_area_name(STEP, SAVE_ID)))  # as upload_early does
    with open(os.path.join(tmp, NAME), "wb") as f:
        f.write(data)
    checksum = integrity.format_checksum(crc32c.crc32c(data))
    remote = RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    keys = RemoteTier(remote).keys(STEP, SAVE_ID)

    upload_locked(LocalTier(backend), remote, keys, NAME, checksum, early=True)

    assert backend.reads >= at, "the commit was not made during the upload"
    assert (tmp_path / "root" / STEP / NAME).exists()
    with open(tmp_path / "remote" / keys.file(NAME), "rb") as f:
        assert f.read() == data
    area = layout.upload_area_name(STEP, SAVE_ID)
    assert backend.exists(area, f"{NAME}.done"), "the early upload was not recorded"


def test_an_early_upload_of_an_abandoned_save_is_deferred(tmp_path):
    """Neither the temporary directory nor the step holds the file: the error goes to the
    caller (which leaves the file to the promotion) and nothing is uploaded."""
    backend = LocalBackend(tmp_path / "root")
    os.makedirs(backend.path_of(layout.tmp_dir_name(STEP, SAVE_ID)))
    os.makedirs(backend.path_of(layout.upload_area_name(STEP, SAVE_ID)))  # as upload_early does
    remote = RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    keys = RemoteTier(remote).keys(STEP, SAVE_ID)
    with pytest.raises(FileNotFoundError):
        upload_locked(LocalTier(backend), remote, keys, NAME, "00000000", early=True)
    assert not (tmp_path / "remote" / keys.file(NAME)).exists()


def test_an_early_upload_that_runs_after_the_promotion_leaves_nothing_behind(tmp_path):
    """An early upload is queued when its file is written (its upload area made then) and
    may run only after the commit's promotion uploaded the file and removed the area (a CI
    run under load once left the area behind, made again by the late upload): it uploads
    nothing and makes no area again."""
    data = os.urandom(2**20)
    backend = LocalBackend(tmp_path / "root")
    os.makedirs(backend.path_of(STEP))  # committed
    with open(backend.path_of(STEP, NAME), "wb") as f:
        f.write(data)
    remote = RemoteBackend(RemoteConfig(url=f"file://{tmp_path / 'remote'}"))
    keys = RemoteTier(remote).keys(STEP, SAVE_ID)
    checksum = integrity.format_checksum(crc32c.crc32c(data))
    # the promotion, the area gone: upload_locked without the area, as the promotion runs it
    upload_locked(LocalTier(backend), remote, keys, NAME, checksum, size=len(data))
    uploaded = os.stat(tmp_path / "remote" / keys.file(NAME)).st_mtime_ns
    area = layout.upload_area_name(STEP, SAVE_ID)
    assert not backend.exists(area)

    assert upload_locked(LocalTier(backend), remote, keys, NAME, checksum, early=True) is None
    assert not backend.exists(area), "the late early upload made its area again"
    assert os.stat(tmp_path / "remote" / keys.file(NAME)).st_mtime_ns == uploaded
