"""Paths an operator or another program leaves under a root: a symbolic link named like one of
our temporary entries is never followed, renamed or deleted, and the save works; ``dcp-tiered
pull`` onto a fresh node makes the root it is given."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageReader, TieredStorageWriter
from dcp_tiered.policy import layout

SUFFIXES = [layout.TMP_SUFFIX, layout.OLD_SUFFIX, layout.DELETE_SUFFIX, layout.UPLOAD_SUFFIX]


@pytest.mark.parametrize("suffix", SUFFIXES)
def test_a_link_named_like_our_leftovers_is_left_alone_and_the_save_works(tmp_path, suffix, caplog):
    root, elsewhere = tmp_path / "root", tmp_path / "someone-elses"
    elsewhere.mkdir()
    (elsewhere / "data.bin").write_bytes(b"not ours")
    old = time.time() - 3600  # long abandoned, by its looks
    os.utime(elsewhere, (old, old))
    root.mkdir()
    link = root / f".shard-12.0a1b2c3d4e5f{suffix}"
    link.symlink_to(elsewhere, target_is_directory=True)
    state = {"w": torch.arange(10.0)}
    with caplog.at_level(logging.WARNING, logger="dcp_tiered"):
        with TieredStorageWriter(root, sync_files=False) as writer:
            writer.recover()
            dcp.save(state, checkpoint_id="shard-12", storage_writer=writer, no_dist=True)
            dcp.save(state, checkpoint_id="shard-13", storage_writer=writer, no_dist=True)
    assert link.is_symlink() and (elsewhere / "data.bin").read_bytes() == b"not ours"
    assert not (root / "shard-12").is_symlink()  # never renamed into a step's place
    assert any(link.name in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    back = {"w": torch.zeros(10)}
    dcp.load(back, checkpoint_id="shard-12", storage_reader=TieredStorageReader(root), no_dist=True)
    assert torch.equal(back["w"], state["w"])


def test_pull_onto_a_fresh_node_makes_its_root(tmp_path):
    remote = f"file://{tmp_path / 'remote'}"
    state = {"w": torch.arange(12.0)}
    with TieredStorageWriter(tmp_path / "trainer", remote=remote) as writer:
        dcp.save(state, checkpoint_id="iter-0042", storage_writer=writer, no_dist=True)
    fresh = tmp_path / "new-node" / "nvme" / "ckpt"  # no part of it exists yet
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcp_tiered.cli",
            "pull",
            str(fresh),
            "latest",
            "--remote",
            remote,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    pulled = json.loads(proc.stdout)
    assert pulled["step"] == "iter-0042"
    # the fresh root takes the run of the remote and its step: the step is the root's own
    assert pulled["run_id"] == writer.run_id
    listing = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "ls", str(fresh), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "foreign" not in listing.stdout and writer.run_id in listing.stdout
    back = {"w": torch.zeros(12)}
    dcp.load(
        back, checkpoint_id="iter-0042", storage_reader=TieredStorageReader(fresh), no_dist=True
    )
    assert torch.equal(back["w"], state["w"])
    # Only pull makes a root: a read-only command still says the path does not exist.
    ls = subprocess.run(
        [sys.executable, "-m", "dcp_tiered.cli", "ls", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert ls.returncode == 2 and "does not exist" in ls.stderr
    assert not (tmp_path / "nowhere").exists()
