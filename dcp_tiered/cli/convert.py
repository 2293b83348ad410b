"""``dcp-tiered convert``: a framework's native checkpoint as world-size-independent DCP, by
the shims' converters (each needs its framework installed)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..errors import DcpTieredError
from ._base import OK, USAGE, error_entry


def cmd_convert(
    args: argparse.Namespace, fields: dict[str, Any], errors: list[dict[str, str]]
) -> int:
    try:
        if args.framework == "megatron":
            from ..shims import megatron_convert  # needs megatron-core

            out = megatron_convert.convert(
                args.src,
                args.dst,
                iteration=args.iteration,
                trust_source=args.trust_source,
                overwrite=args.overwrite,
            )
        else:
            from ..shims import deepspeed_convert  # needs DeepSpeed

            out = deepspeed_convert.convert(
                args.src,
                args.dst,
                tag=args.tag,
                native=args.native,
                trust_source=args.trust_source,
                overwrite=args.overwrite,
                work_dir=args.work_dir,
            )
    except DcpTieredError as e:
        print(f"dcp-tiered: {e}", file=sys.stderr)
        errors.append(error_entry(e))
        return USAGE
    fields.update(src=args.src, dst=args.dst, framework=args.framework, output=str(out))
    if not args.json:
        print(out)
    return OK
