"""Command line: ``dcp-tiered ls ROOT``, ``verify ROOT [STEP]``, ``status ROOT`` and
``convert deepspeed|megatron SRC DST``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

# Only the standard library at import time: `--help`, `--version` and usage errors answer
# without importing torch (seconds). Each command imports what it needs.
if TYPE_CHECKING:
    from .tiers.local import LocalTier

def _human(n: float) -> str:
    unit = "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024:
            break
        n /= 1024
    return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"


def cmd_ls(tier: LocalTier) -> int:
    from .policy import layout

    rows = []
    for s in sorted(tier.steps(), key=lambda s: s.committed_at_ns):
        size = sum(tier.backend.file_size(s.name, f) for f in tier.backend.list_files(s.name))
        if s.verified_format:
            when = datetime.datetime.fromtimestamp(s.committed_at_ns / 1e9).isoformat(" ", "seconds")
            state = f"committed  world={tier.read_manifest(s.name).world_size}  {when}"
        else:
            state = "vanilla DCP (no manifest: cannot be verified)"
        rows.append((s.name, _human(size), state))
    for name in tier.backend.list_names():
        parsed = layout.parse_hidden_dir(name)
        if parsed and parsed[2] == layout.TMP_SUFFIX:
            busy = tier.backend.exists(name, layout.LOCK_NAME) and tier.backend.is_locked(name)
            rows.append((parsed[0], "-", "in progress" if busy else "abandoned (swept by the next writer)"))
        elif parsed and parsed[2] == layout.QUARANTINE_SUFFIX:
            rows.append((parsed[0], "-", f"quarantined as {name} (a restore fell back past it; "
                                        "kept for inspection, delete it by hand)"))
    if not rows:
        print(f"no steps in {tier.root}")
        return 0
    width = max(len(r[0]) for r in rows)
    for name, size, state in rows:
        print(f"{name:<{width}}  {size:>10}  {state}")
    return 0


def cmd_verify(tier: LocalTier, step: str | None) -> int:
    from .tiers import catalog

    steps = [catalog.resolve(tier, None, step).name] if step else [s.name for s in tier.steps()]
    bad = 0
    for name in steps:
        info = next(s for s in tier.steps() if s.name == name)
        if not info.verified_format:
            print(f"{name}: vanilla DCP checkpoint without a manifest, cannot be verified")
            bad += 1
            continue
        problems = _verify_step(tier, name)
        print(f"{name}: " + ("OK" if not problems else "CORRUPT\n  " + "\n  ".join(problems)))
        bad += bool(problems)
    return 1 if bad else 0


def _verify_step(tier: LocalTier, step: str) -> list[str]:
    from tqdm import tqdm

    from .policy import integrity

    m = tier.read_manifest(step)
    total = sum(int(f["size"]) for f in m.files.values())
    problems = []
    with tqdm(total=total, unit="B", unit_scale=True, desc=step, leave=False,
              disable=total < 256 * 2**20) as bar:
        for name, info in sorted(m.files.items()):
            if not tier.backend.exists(step, name):
                problems.append(f"{name}: missing")
                continue
            size = tier.backend.file_size(step, name)
            if size != int(info["size"]):
                problems.append(f"{name}: {size} bytes, manifest says {info['size']}")
                continue
            crc = tier.backend.file_checksum(step, name, progress=bar.update)
            if crc != info["checksum"]:
                problems.append(f"{name}: {integrity.ALGORITHM} {crc} != manifest {info['checksum']}")
    return problems


def _in_progress(tier: LocalTier) -> set[str]:
    from .policy import layout

    return {p[0] for n in tier.backend.list_names()
            if (p := layout.parse_hidden_dir(n)) and p[2] == layout.TMP_SUFFIX}


UNREADABLE = 3  # exit status of `status` when a tier could not be read


def cmd_status(tier: LocalTier, memory: str | None, remote_url: str | None, as_json: bool) -> int:
    """Every step of every tier, and how durable it is. A tier that cannot be read is named
    (stderr, and ``unreadable`` in JSON) and the exit status is 3: its steps are unknown."""
    from .backends.remote import remote_backend
    from .config import RemoteConfig, RetryConfig
    from .errors import ManifestError, TierUnavailableError
    from .policy import layout
    from .tiers import catalog
    from .tiers import memory as memory_tier

    recorded = {}
    if tier.backend.exists(layout.TIERS_RECORD):
        recorded = json.loads(tier.backend.read_file(layout.TIERS_RECORD))
    memory = memory or recorded.get("memory")
    url = remote_url or recorded.get("remote")
    # Two attempts, not eight: an operator wants the answer, not a minute of retries.
    remote = remote_backend(RemoteConfig(url=url, retry=RetryConfig(max_attempts=2))
                            if url else None)
    rows: dict[str, dict] = {}
    for name in (memory_tier.list_steps(memory) if memory else {}):
        rows.setdefault(name, {})["memory"] = True
    unreadable: dict[str, str] = {}
    try:
        listed = catalog.list_steps(tier, remote, strict=True)
    except TierUnavailableError as e:
        unreadable["remote"] = str(e)
        print(f"dcp-tiered: {e}", file=sys.stderr)
        listed = catalog.list_steps(tier, None)
    for s in listed:
        row = rows.setdefault(s.name, {})
        row["local"], row["remote"] = s.local, None if unreadable else s.remote
        if s.local and not s.remote and s.verified_format and remote is not None:
            try:
                row["promote"] = tier.read_manifest(s.name).promote
            except ManifestError:
                row["promote"] = False
    for name in _in_progress(tier):
        rows.setdefault(name, {})["saving"] = True
    for row in rows.values():
        row["durability"] = ("durable-remote" if row.get("remote") else
                             "committed-local" if row.get("local") else
                             "memory" if row.get("memory") else "staged")
        if row.get("promote"):
            row["durability"] += (" (remote unreadable)" if unreadable
                                  else " (upload pending)")
    ordered = sorted(rows.items(), key=lambda kv: (layout.step_number(kv[0]) or -1, kv[0]))
    status = UNREADABLE if unreadable else 0
    if as_json:
        print(json.dumps({"root": tier.root, "memory": memory,
                          "remote": remote.config.url if remote else None,
                          "unreadable": unreadable,
                          "steps": [{"step": k, **v} for k, v in ordered]}, indent=1))
        return status
    print(f"local:  {tier.root}\nmemory: {memory or '-'}\n"
          f"remote: {remote.config.url if remote else '-'}"
          + (" (CANNOT BE READ: its steps are unknown)" if unreadable else ""))
    if not ordered:
        print("no steps")
        return status
    width = max(len(k) for k, _ in ordered)
    print(f"{'step':<{width}}  memory  local  remote  durability")
    mark = {True: "yes", False: "-", None: "?" if unreadable else "-"}
    for name, row in ordered:
        print(f"{name:<{width}}  {mark[row.get('memory')]:<6}  {mark[row.get('local')]:<5}  "
              f"{mark[row.get('remote')]:<6}  {row['durability']}")
    return status


def cmd_convert(args: argparse.Namespace) -> int:
    from .errors import DcpTieredError

    try:
        if args.framework == "megatron":
            from .shims import megatron_convert  # needs megatron-core

            out = megatron_convert.convert(args.src, args.dst, iteration=args.iteration,
                                           trust_source=args.trust_source,
                                           overwrite=args.overwrite)
        else:
            from .shims import deepspeed_convert  # needs DeepSpeed

            out = deepspeed_convert.convert(args.src, args.dst, tag=args.tag, native=args.native,
                                            trust_source=args.trust_source,
                                            overwrite=args.overwrite, work_dir=args.work_dir)
    except DcpTieredError as e:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dcp-tiered", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list steps with sizes and state")
    ls.add_argument("root")
    verify = sub.add_parser("verify", help="check every file against its manifest checksum")
    verify.add_argument("root")
    verify.add_argument("step", nargs="?", help="a step name or 'latest' (default: all steps)")
    status = sub.add_parser("status", help="steps of every tier (memory, local, remote) and "
                            "their durability")
    status.add_argument("root", help="the local tier's directory")
    status.add_argument("--memory", help="memory-tier directory (default: recorded in ROOT)")
    status.add_argument("--remote", help="remote URL (default: recorded in ROOT); S3 "
                        "credentials and endpoint come from the AWS_* environment")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    convert = sub.add_parser("convert", help="a framework's native checkpoint as "
                             "world-size-independent DCP (full params + per-param optimizer "
                             "state)")
    convert.add_argument("framework", choices=["deepspeed", "megatron"])
    convert.add_argument("src", help="DeepSpeed: save directory (uses 'latest') or tag directory; "
                         "Megatron: a legacy (--ckpt-format torch) save directory")
    convert.add_argument("dst", help="tier root the DCP step is written into (named after the "
                         "tag, or iter_XXXXXXX)")
    convert.add_argument("--tag", help="DeepSpeed: the tag to convert (default: the one 'latest' "
                         "names)")
    convert.add_argument("--iteration", type=int, help="Megatron: the iteration to convert "
                         "(default: the one latest_checkpointed_iteration.txt names)")
    convert.add_argument("--native", action="store_true", help="for a dcp_tiered DeepSpeed "
                         "step: write DeepSpeed's own files into DST/TAG instead (for "
                         "zero_to_fp32 and other DeepSpeed tools)")
    convert.add_argument("--trust-source", action="store_true", help="skip the weights_only "
                         "check of native input files (they get unpickled by DeepSpeed's tool)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace DST's step of the same name")
    convert.add_argument("--work-dir", help="scratch space for the intermediate universal "
                         "checkpoint (default: the system temp dir; needs about 3x the "
                         "fp32 model size)")
    args = parser.parse_args(argv)
    if args.command == "convert":
        return cmd_convert(args)
    if not os.path.isdir(args.root):
        what = "is not a directory" if os.path.exists(args.root) else "does not exist"
        print(f"dcp-tiered: {args.root} {what}: give the local tier's directory (the root the "
              "writer or manager saved into)", file=sys.stderr)
        return 2
    from .backends.local import LocalBackend
    from .errors import DcpTieredError
    from .tiers.local import LocalTier

    tier = LocalTier(LocalBackend(args.root))
    try:
        if args.command == "ls":
            return cmd_ls(tier)
        if args.command == "status":
            return cmd_status(tier, args.memory, args.remote, args.json)
        return cmd_verify(tier, args.step)
    except DcpTieredError as e:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
