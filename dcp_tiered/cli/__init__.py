"""Command line: ``dcp-tiered ls|verify|status|inspect|diff|export|pull|rm|prune|adopt|quarantine|
convert``.

Exit status, every command: 0 done; 1 a problem was found in the data (a corrupt or missing
file, a manifest that does not parse); 2 usage or configuration error, or a refusal (nothing was
changed); 3 a tier could not be read, so the answer is incomplete. With ``--json`` every command
prints one JSON object on stdout (schema in docs/cli.md), also when it fails.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._version import __version__
from ._base import OK, PROBLEM, UNREADABLE, USAGE, envelope, error_entry

# Only the standard library at import time: `--help`, `--version` and usage errors answer
# without importing torch (seconds). Each command's module is imported after parsing, by name:
# command -> (module of this package, function). No command module imports this one.
COMMANDS = {
    "ls": ("steps", "cmd_ls"),
    "verify": ("steps", "cmd_verify"),
    "status": ("steps", "cmd_status"),
    "inspect": ("steps", "cmd_inspect"),
    "diff": ("data", "cmd_diff"),
    "export": ("export", "cmd_export"),
    "pull": ("ops", "cmd_pull"),
    "rm": ("ops", "cmd_rm"),
    "prune": ("ops", "cmd_prune"),
    "adopt": ("runs", "cmd_adopt"),
    "quarantine": ("runs", "cmd_quarantine"),
    "convert": ("convert", "cmd_convert"),
}
_VERIFY_REMOTE = ("data", "cmd_verify_remote")  # verify --remote


def _command(command: str, args: argparse.Namespace) -> Callable[..., int]:
    """The function that runs ``command``, its module imported now."""
    module, function = COMMANDS[command]
    if command == "verify" and getattr(args, "remote", None) is not None:
        module, function = _VERIFY_REMOTE
    run: Callable[..., int] = getattr(importlib.import_module(f"{__name__}.{module}"), function)
    return run


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # raise instead of exiting: main() returns the code
        raise _UsageError(f"{self.format_usage()}{self.prog}: error: {message}")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dcp-tiered", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"dcp-tiered {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    json_help = "one JSON object on stdout (schema: docs/cli.md)"

    def command(
        name: str, help: str, *, root: str = "the local tier's directory", remote: str | None = None
    ) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument("root", help=root)
        p.add_argument("--json", action="store_true", help=json_help)
        if remote:
            p.add_argument("--remote", metavar="URL", help=remote)
        return p

    def instead_on_remote(p: argparse.ArgumentParser, what: str) -> None:
        """``--remote [URL]``: act on the remote tier instead (URL: the one ROOT records)."""
        p.add_argument(
            "--remote",
            nargs="?",
            const="",
            metavar="URL",
            help=f"{what} (URL: default the one recorded in ROOT)",
        )

    remote_help = (
        "remote URL (default: the one recorded in ROOT); S3 credentials and "
        "endpoint come from the AWS_* environment"
    )
    command("ls", "list steps with sizes and state")
    verify = command("verify", "check every file against its manifest checksum")
    verify.add_argument("step", nargs="?", help="a step name or 'latest' (default: all steps)")
    verify.add_argument(
        "--remote",
        nargs="?",
        const="",
        metavar="URL",
        help="check the remote copy instead: sizes, and checksums where the store recorded "
        "them at upload (no download); other objects are read back (URL: default the one "
        "recorded in ROOT; give STEP before --remote)",
    )
    verify.add_argument(
        "--read-back",
        action="store_true",
        help="with --remote: read every object back and checksum its bytes",
    )
    status = command(
        "status",
        "steps of every tier (memory, local, remote) and their durability",
        remote=remote_help,
    )
    status.add_argument("--memory", help="memory-tier directory (default: recorded in ROOT)")
    inspect = command(
        "inspect",
        "tensors, shapes, dtypes and bytes per rank of a step, from "
        "its manifest alone (no data is read)",
        remote=remote_help,
    )
    inspect.add_argument(
        "step",
        nargs="?",
        default="latest",
        help="a step name or 'latest' (default), local or remote",
    )
    diff = command(
        "diff",
        "which tensors and values of two steps differ, and by how much "
        "(every item verified; exit 1 when they differ)",
        remote=remote_help,
    )
    diff.add_argument("step_a", help="a step name or 'latest'")
    diff.add_argument("step_b", help="a step name or 'latest'")
    export = command(
        "export",
        "a step's tensors as Hugging Face style sharded safetensors (or torch.save "
        "shards) with an index, streamed from any tier, every item verified",
        remote=remote_help,
    )
    export.add_argument("step", help="a step name or 'latest'")
    export.add_argument("out", help="the directory to create (must not exist, unless --force)")
    export.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    export.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest output file (a larger tensor gets its own): 5GB (default), 500MiB, bytes",
    )
    export.add_argument(
        "--prefix",
        help="export only the tensors whose name starts with PREFIX, named without it "
        "(e.g. 'app.model.')",
    )
    export.add_argument("--force", action="store_true", help="replace an existing OUT")
    pull = command(
        "pull",
        "copy a durable remote step to the local tier: every file "
        "verified against the manifest, committed atomically",
        remote=remote_help,
    )
    pull.add_argument("step", help="a step name or 'latest'")
    rm = command(
        "rm",
        "delete a step from the local tier, or with --remote from the remote "
        "tier; refuses the only durable copy without --force",
    )
    rm.add_argument("step", help="the step name")
    instead_on_remote(rm, "delete the remote copy instead of the local one")
    rm.add_argument(
        "--force", action="store_true", help="delete even the only durable copy of the step"
    )
    prune = command(
        "prune",
        "delete the local tier's old steps by retention: never the newest, "
        "a milestone, or a step not yet durable on the remote",
        remote=remote_help,
    )
    prune.add_argument(
        "--keep-latest",
        type=int,
        required=True,
        metavar="N",
        help="keep the newest N committed steps (N >= 1)",
    )
    prune.add_argument(
        "--keep-every",
        type=int,
        metavar="K",
        help="also keep every step whose number is a multiple of K",
    )
    prune.add_argument(
        "--dry-run", action="store_true", help="say what would be deleted, delete nothing"
    )
    adopt = command(
        "adopt",
        "make steps saved before run identities, or by another run, the steps of the run "
        "ROOT records (retention, rm, quarantine and uploads then treat them as its own)",
    )
    adopt.add_argument("steps", nargs="*", metavar="STEP", help="step names (default: all)")
    instead_on_remote(adopt, "adopt the remote tier's steps instead")
    adopt.add_argument("--run-id", help="for a ROOT that records no run yet: its run id")
    quarantine = command(
        "quarantine",
        "move one of the run's steps aside (never deleted, listed, restored or pruned), or "
        "with --release give a quarantined save its name back",
    )
    quarantine.add_argument("step", help="the step name")
    instead_on_remote(quarantine, "on the remote tier instead")
    quarantine.add_argument("--release", action="store_true", help="undo a quarantine")
    quarantine.add_argument(
        "--save-id", help="with --release: which quarantined save (when there are several)"
    )
    quarantine.add_argument("--reason", help="recorded with the quarantine")
    convert = sub.add_parser(
        "convert",
        help="a framework's native checkpoint as "
        "world-size-independent DCP (full params + per-param optimizer "
        "state)",
    )
    convert.add_argument("framework", choices=["deepspeed", "megatron"])
    convert.add_argument(
        "src",
        help="DeepSpeed: save directory (uses 'latest') or tag directory; "
        "Megatron: a legacy (--ckpt-format torch) save directory",
    )
    convert.add_argument(
        "dst", help="tier root the DCP step is written into (named after the tag, or iter_XXXXXXX)"
    )
    convert.add_argument("--json", action="store_true", help=json_help)
    convert.add_argument(
        "--tag", help="DeepSpeed: the tag to convert (default: the one 'latest' names)"
    )
    convert.add_argument(
        "--iteration",
        type=int,
        help="Megatron: the iteration to convert "
        "(default: the one latest_checkpointed_iteration.txt names)",
    )
    convert.add_argument(
        "--native",
        action="store_true",
        help="for a dcp_tiered DeepSpeed "
        "step: write DeepSpeed's own files into DST/TAG instead (for "
        "zero_to_fp32 and other DeepSpeed tools)",
    )
    convert.add_argument(
        "--trust-source",
        action="store_true",
        help="skip the weights_only "
        "check of native input files (they get unpickled by DeepSpeed's tool)",
    )
    convert.add_argument(
        "--overwrite", action="store_true", help="replace DST's step of the same name"
    )
    convert.add_argument(
        "--work-dir",
        help="scratch space for the intermediate universal "
        "checkpoint (default: the system temp dir; needs about 3x the "
        "fp32 model size)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        args = _parser().parse_args(argv)
    except _UsageError as e:
        print(e, file=sys.stderr)
        if as_json:
            print(
                json.dumps(envelope(None, USAGE, [{"type": "UsageError", "message": str(e)}], {}))
            )
        return int(USAGE)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else OK
    fields: dict[str, Any] = {}
    errors: list[dict[str, str]] = []
    code = _run(args, fields, errors)
    if args.json:
        print(json.dumps(envelope(args.command, code, errors, fields), indent=1))
    return int(code)


def _run(args: argparse.Namespace, fields: dict[str, Any], errors: list[dict[str, str]]) -> int:
    """Run the command; errors are said on stderr and collected for --json."""
    if args.command == "convert":  # no tier root: DST is the one written
        return _command("convert", args)(args, fields, errors)
    if args.command == "pull":  # a fresh node's local tier: the pull makes its root
        with contextlib.suppress(OSError):  # a file there, or no permission: said below
            os.makedirs(args.root, exist_ok=True)
    if not os.path.isdir(args.root):
        what = "is not a directory" if os.path.exists(args.root) else "does not exist"
        message = (
            f"{args.root} {what}: give the local tier's directory (the root the writer "
            "or manager saved into)"
        )
        print(f"dcp-tiered: {message}", file=sys.stderr)
        errors.append({"type": "ConfigError", "message": message})
        return USAGE
    handler = _command(args.command, args)
    from ..errors import (
        DcpTieredError,
        IntegrityError,
        ManifestError,
        MissingShardError,
        TierError,
    )
    from ._context import Run

    # The tiers log every delete and every tier they cannot reach: show those to the operator.
    log = logging.getLogger("dcp_tiered")
    shown = logging.StreamHandler(sys.stderr)
    shown.setFormatter(logging.Formatter("dcp-tiered: %(message)s"))
    shown.setLevel(
        logging.INFO
        if args.command in ("pull", "rm", "prune", "export", "adopt", "quarantine")
        else logging.WARNING
    )
    log.addHandler(shown)
    level = log.level
    log.setLevel(min(level or logging.WARNING, shown.level))
    try:
        return handler(Run(args, fields, errors))
    except DcpTieredError as e:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        errors.append(error_entry(e))
        if isinstance(e, (IntegrityError, ManifestError, MissingShardError)):
            return PROBLEM
        return UNREADABLE if isinstance(e, TierError) else USAGE
    finally:
        log.removeHandler(shown)
        log.setLevel(level)
