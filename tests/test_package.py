"""The package's import surface: light to import, every public name there, no stale path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dcp_tiered

_NO_TORCH = (
    "import sys; {body}; "
    "heavy = sorted(m for m in ('torch', 'numpy', 'fsspec') if m in sys.modules); "
    "print(heavy); sys.exit(1 if heavy else 0)"
)


def _run(body: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(body=body), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_importing_the_package_and_cli_help_does_not_import_torch():
    """`dcp-tiered --help` took ~3 s, all of it importing torch it did not need."""
    assert (p := _run("import dcp_tiered, dcp_tiered.cli")).returncode == 0, p.stdout + p.stderr
    for args in (["--help"], ["--version"], ["ls"], ["no-such-command"], ["prune", "r"]):
        body = (
            "from dcp_tiered.cli import main\n"
            "try: code = main(sys.argv[1:])\n"
            "except SystemExit as e: code = e.code"
        )
        p = _run(f"exec({body!r})", *args)
        assert p.returncode == 0, (args, p.stdout, p.stderr)


def test_every_public_name_resolves_and_no_old_module_path_does():
    for name in dcp_tiered.__all__:
        assert getattr(dcp_tiered, name) is not None, name
    ns: dict = {}
    exec("from dcp_tiered import *", ns)  # noqa: S102 (a star import is the case to test)
    assert set(dcp_tiered.__all__) <= set(ns)
    from dcp_tiered import CheckpointManager, TieredStorageWriter, manager, writer

    assert TieredStorageWriter is writer.TieredStorageWriter
    assert CheckpointManager is manager.CheckpointManager
    # The module paths before the moves into policy/ and tiers/ are gone (never released).
    for old in ("layout", "tiering", "local_tier", "manifest"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"dcp_tiered.{old}")
        with pytest.raises(AttributeError):
            getattr(dcp_tiered, old)
    assert "TieredStorageReader" in dir(dcp_tiered)
