from __future__ import annotations

import subprocess
import sys

import torch
import torch.distributed.checkpoint as dcp

from dcp_tiered import TieredStorageWriter
from dcp_tiered.cli import main


def _save(root, step):
    dcp.save({"w": torch.ones(1000)}, checkpoint_id=step, storage_writer=TieredStorageWriter(root),
             no_dist=True)


def test_ls_lists_steps_sizes_and_state(tmp_path, capsys):
    _save(tmp_path, "step-1")
    _save(tmp_path, "step-2")
    (tmp_path / ".step-3.abc.dcp-tiered-tmp").mkdir()
    assert main(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "step-1" in out and "step-2" in out and "committed" in out and "KiB" in out
    assert "step-3" in out and "abandoned" in out


def test_verify_detects_flipped_byte(tmp_path, capsys):
    _save(tmp_path, "step-1")
    _save(tmp_path, "step-2")
    assert main(["verify", str(tmp_path)]) == 0
    data_file = next((tmp_path / "step-2").glob("*.distcp"))
    raw = bytearray(data_file.read_bytes())
    raw[-20] ^= 0xFF
    data_file.write_bytes(bytes(raw))
    assert main(["verify", str(tmp_path), "step-1"]) == 0
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "step-1: OK" in out and "step-2: CORRUPT" in out and data_file.name in out


def test_verify_unknown_step_is_a_clear_error(tmp_path):
    _save(tmp_path, "step-1")
    proc = subprocess.run([sys.executable, "-m", "dcp_tiered.cli", "verify", str(tmp_path),
                           "step-7"], capture_output=True, text=True)
    assert proc.returncode == 2 and "step-1" in proc.stderr and "step-7" in proc.stderr
