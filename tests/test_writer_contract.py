"""The writer's contract with its owner: a frozen WriterConfig in, the root's Tiers given (or
built and closed by a writer used alone), a SaveRequest per save, and one SaveReport per save
out on the tiers."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import (
    ConfigError,
    Durability,
    RemoteConfig,
    SaveRequest,
    TieredStorageWriter,
    WriterConfig,
)
from dcp_tiered.tiers.root import Tiers
from tests.test_remote_tier import FAST_RETRY


def _save(writer: TieredStorageWriter, checkpoint_id: object) -> None:
    dcp.save(
        {"w": torch.arange(8.0)}, checkpoint_id=checkpoint_id, storage_writer=writer, no_dist=True
    )


def test_the_config_is_frozen_keyword_only_and_checked():
    config = WriterConfig(overwrite=True, thread_count=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.overwrite = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        WriterConfig(True)  # type: ignore[misc]
    with pytest.raises(ConfigError, match="thread_count"):
        WriterConfig(thread_count=0)


def test_the_writers_keyword_arguments_build_its_config(tmp_path):
    writer = TieredStorageWriter(tmp_path, overwrite=True, sync_files=False)
    assert writer.config == WriterConfig(overwrite=True, sync_files=False)
    assert TieredStorageWriter(tmp_path, config=writer.config).config is writer.config
    with pytest.raises(ConfigError, match="not both"):
        TieredStorageWriter(tmp_path, config=writer.config, overwrite=False)
    with pytest.raises(TypeError):
        TieredStorageWriter(tmp_path, no_such_option=1)


def test_a_save_reports_its_timings_and_its_upload_to_the_tiers_owner(tmp_path):
    remote = RemoteConfig(url=f"file://{tmp_path}/remote", retry=FAST_RETRY)
    tiers = Tiers.open(tmp_path / "local", remote)
    writer = TieredStorageWriter(tiers, sync_files=False)
    _save(writer, "step-1")
    pickle.loads(pickle.dumps(writer))  # as PROCESS mode does: a report's future stays here
    report = tiers.take_report("step-1")
    assert report is not None and tiers.take_report("step-1") is None  # taken once
    assert report.write_s > 0 and report.commit_s is not None and report.uploads
    assert report.upload is not None
    started, durable = report.upload.result(timeout=60)
    assert started <= durable
    assert tiers.durability("step-1") == Durability.DURABLE_REMOTE
    writer.close()
    tiers.close()


def test_a_save_request_keeps_a_step_local(tmp_path):
    remote = RemoteConfig(url=f"file://{tmp_path}/remote", retry=FAST_RETRY)
    tiers = Tiers.open(tmp_path / "local", remote)
    writer = TieredStorageWriter(tiers, sync_files=False)
    _save(writer, SaveRequest("step-1", promote=False))
    _save(writer, "step-2")  # the request was for one save only
    local_only, promoted = tiers.take_report("step-1"), tiers.take_report("step-2")
    assert local_only is not None and not local_only.uploads and local_only.upload is None
    assert promoted is not None and promoted.upload is not None
    promoted.upload.result(timeout=60)
    assert writer.durability("step-1") == Durability.COMMITTED_LOCAL
    assert writer.durability("step-2") == Durability.DURABLE_REMOTE
    writer.close()
    tiers.close()


def test_the_owner_closes_the_tiers_it_gave_and_a_lone_writer_its_own(tmp_path):
    remote = RemoteConfig(url=f"file://{tmp_path}/remote", retry=FAST_RETRY)
    tiers = Tiers.open(tmp_path / "given", remote)
    given = TieredStorageWriter(tiers, sync_files=False)
    _save(given, "step-1")
    given.close()
    assert tiers.upload_queue() is tiers.upload_queue()  # still the owner's, still open
    tiers.close()
    with pytest.raises(ConfigError, match="Tiers.open"):
        TieredStorageWriter(tiers, remote=remote)

    own = dataclasses.replace(remote, url=f"file://{tmp_path}/remote-alone")
    alone = TieredStorageWriter(tmp_path / "alone", remote=own, sync_files=False)
    _save(alone, "step-1")
    alone.close()  # waits for its own upload
    assert alone.durability("step-1") == Durability.DURABLE_REMOTE


def test_the_options_read_as_attributes_as_before_and_cannot_be_set(tmp_path):
    """``writer.thread_count`` and the other options still read as before WriterConfig; setting
    one, which would change nothing now, is refused."""
    writer = TieredStorageWriter(tmp_path, thread_count=3, sync_files=False)
    assert (writer.thread_count, writer.sync_files, writer.overwrite) == (3, False, False)
    with pytest.raises(AttributeError, match="fixed when the writer is built"):
        writer.thread_count = 5
    assert writer.config.thread_count == 3
    with pytest.raises(AttributeError, match="no_such_option"):
        writer.no_such_option  # noqa: B018 - the attribute lookup is the test
