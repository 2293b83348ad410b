"""``dcp-tiered export``: a step as Hugging Face style sharded safetensors (or torch.save
shards), from whichever tier holds it.

Streaming: the shards' layout comes from the manifest alone (shapes, dtypes), so each
safetensors shard's header is written first and its tensors follow one batch at a time, each
assembled whole from the step's chunks and verified on the way (:class:`StepItems`). Memory:
one tensor (or a batch of small ones), not the state. safetensors' own writer wants every
tensor of a file in memory at once, so the (simple, documented) format is written here, and the
``safetensors`` package then opens each shard to check it. ``--format torch`` holds one shard in
memory (torch.save has no streaming form). Non-tensor items have no place in either format:
they are left out and listed. The output appears whole or not at all: it is built in a hidden
directory beside ``OUT`` and renamed into place.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointExistsError, ConfigError, ForeignPathError, InsufficientSpaceError
from ..tiers import catalog
from ._base import OK, human
from ._context import Run, progress
from ._items import StepItems

logger = logging.getLogger(__name__)

# Written into every export: what --force may replace (an export of ours, and only its files)
EXPORT_RECORD, EXPORT_FORMAT = ".dcp-tiered-export.json", "dcp-tiered-export"

# torch dtype -> safetensors dtype name (the format's spec; the package checks every shard)
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.complex64: "C64",
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str) -> int:
    """'5GB' (10^9), '500MiB' (2^20), '1000000' (bytes), as Hugging Face's max_shard_size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: give a size such as 5GB, 500MiB or bytes")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _nbytes(md: TensorStorageMetadata) -> int:
    return math.prod(md.size) * md.properties.dtype.itemsize


def plan_shards(sizes: list[tuple[str, int]], limit: int) -> list[list[str]]:
    """Names in order, split into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes:
        if shards[-1] and used + nbytes > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards if shards[0] else []


def _safetensors_header(tensors: list[tuple[str, TensorStorageMetadata]]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, md in tensors:
        end = offset + _nbytes(md)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[md.properties.dtype],
            "shape": list(md.size),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def cmd_export(run: Run) -> int:
    args = run.args
    if args.format == "safetensors":
        try:
            import safetensors  # noqa: F401  (checks every shard written)
        except ImportError as e:
            raise ConfigError(
                "--format safetensors needs the safetensors package: "
                "pip install 'dcp-tiered[export]' (or use --format torch)"
            ) from e
    limit = parse_size(args.max_shard_size)
    out = os.path.abspath(args.out)
    parent = os.path.dirname(out)
    if not os.path.isdir(parent):
        raise ConfigError(f"{parent} is not a directory: OUT's parent must exist")
    root = os.path.realpath(run.tier.root)
    if os.path.commonpath([os.path.realpath(out), root]) in (root, os.path.realpath(out)):
        raise ConfigError(  # --force would replace a step, or the whole tier
            f"{out} is inside the tier root {root} (or holds it): export outside it"
        )
    if os.path.lexists(out) and not args.force:
        raise CheckpointExistsError(
            f"{out} exists: nothing was written. Give another OUT, or --force to replace it"
        )
    if os.path.lexists(out):
        _require_export(out)
    m, source = catalog.step_manifest(run.tier, run.remote(), args.step)
    prefix = args.prefix or ""
    tensors: list[tuple[str, str, TensorStorageMetadata]] = []  # (fqn, name written, md)
    skipped: list[dict[str, str]] = []
    for fqn, md in sorted(m.metadata.state_dict_metadata.items()):
        if not fqn.startswith(prefix):
            continue
        if isinstance(md, TensorStorageMetadata):
            tensors.append((fqn, fqn[len(prefix) :], md))
        else:
            skipped.append({"fqn": fqn, "reason": "not a tensor (a torch.save'd object)"})
    if not tensors:
        raise ConfigError(f"step {m.step} has no tensor" + (f" under {prefix!r}" if prefix else ""))
    if args.format == "safetensors":
        unsupported = [f for f, _, md in tensors if md.properties.dtype not in _SAFETENSORS_DTYPES]
        if unsupported:
            raise ConfigError(
                f"safetensors has no dtype for {unsupported[:5]} of step {m.step}; "
                "use --format torch"
            )
    total = sum(_nbytes(md) for _, _, md in tensors)
    if total > (free := shutil.disk_usage(parent).free):
        raise InsufficientSpaceError(
            28, f"exporting {m.step} needs {human(total)} in {parent}, {human(free)} are free"
        )
    remote = run.remote()
    items = StepItems(run.tier.root, m.step, remote.config if remote is not None else None)
    by_name = {name: (fqn, md) for fqn, name, md in tensors}
    shards = plan_shards([(name, _nbytes(md)) for _, name, md in tensors], limit)
    stem, suffix = (
        ("model", "safetensors") if args.format == "safetensors" else ("pytorch_model", "bin")
    )
    files = [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)]
    tmp = os.path.join(parent, f".{os.path.basename(out)}.export-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)
    started = time.monotonic()
    try:
        with progress(total, f"export {m.step}", run) as bar:
            for file, names in zip(files, shards):
                path = os.path.join(tmp, file)
                stream = items.tensors(by_name[n][0] for n in names)
                if args.format == "safetensors":
                    _write_safetensors(path, [(n, by_name[n][1]) for n in names], stream, bar)
                else:
                    shard = {}
                    for name, (_, tensor) in zip(names, stream):
                        shard[name] = tensor
                        bar.update(tensor.nbytes)
                    torch.save(shard, path)
                    del shard
                _fsync(path)
        index = {
            "metadata": {"total_size": total},
            "weight_map": {n: file for file, names in zip(files, shards) for n in names},
        }
        with open(os.path.join(tmp, f"{stem}.{suffix}.index.json"), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        record = {
            "format": EXPORT_FORMAT,
            "step": m.step,
            "save_id": m.save_id,
            "files": [*files, f"{stem}.{suffix}.index.json"],
        }
        with open(os.path.join(tmp, EXPORT_RECORD), "w") as f:
            json.dump(record, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        _fsync(tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # our own hidden directory, never published
        raise
    seconds = time.monotonic() - started
    run.fields.update(
        step=m.step,
        source=source,
        save_id=m.save_id,
        world_size=m.world_size,
        format=args.format,
        out=out,
        index=f"{stem}.{suffix}.index.json",
        files=[
            {
                "name": file,
                "tensors": len(names),
                "bytes": sum(_nbytes(by_name[n][1]) for n in names),
            }
            for file, names in zip(files, shards)
        ],
        tensors=len(tensors),
        bytes=total,
        skipped=skipped,
        seconds=round(seconds, 3),
    )
    run.say(
        f"{m.step} ({source}) -> {out}: {len(tensors)} tensors, {human(total)} in "
        f"{len(files)} {args.format} files, {seconds:.1f} s, every item verified"
    )
    if skipped:
        run.say(
            f"left out {len(skipped)} non-tensor items ({args.format} holds tensors only): "
            + ", ".join(s["fqn"] for s in skipped)
        )
    return OK


def _write_safetensors(
    path: str, tensors: list[tuple[str, TensorStorageMetadata]], stream: Any, bar: Any
) -> None:
    from safetensors import safe_open

    header = _safetensors_header(tensors)
    expected = len(header) + sum(_nbytes(md) for _, md in tensors)
    with open(path, "xb") as f:
        f.write(header)
        for (name, md), (fqn, tensor) in zip(tensors, stream):
            if tensor.dtype != md.properties.dtype or tensor.shape != md.size:
                raise AssertionError(f"{fqn}: read {tensor.dtype} {tuple(tensor.shape)}")
            f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
            bar.update(tensor.nbytes)
            del tensor
        if f.tell() != expected:
            raise AssertionError(f"{path}: wrote {f.tell()} bytes, expected {expected}")
    with safe_open(path, framework="pt") as check:  # the package's own parser agrees
        if set(check.keys()) != {name for name, _ in tensors}:
            raise AssertionError(f"{path}: safetensors reads other tensors than were written")


def _require_export(out: str) -> None:
    """ForeignPathError unless ``out`` is an earlier export of ours: a directory (not a link)
    holding our export record and nothing but the files that record lists. ``--force`` never
    replaces anything else (a tier, another root's steps, a user's directory)."""
    problem = None
    if os.path.islink(out) or not os.path.isdir(out):
        problem = "it is not a directory"
    else:
        try:
            with open(os.path.join(out, EXPORT_RECORD), "rb") as f:
                body = json.loads(f.read(1 << 20))
            listed = set(body["files"]) if body.get("format") == EXPORT_FORMAT else None
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            listed = None
        if listed is None:
            problem = f"it holds no readable {EXPORT_RECORD} (not made by dcp-tiered export)"
        elif extra := sorted(set(os.listdir(out)) - listed - {EXPORT_RECORD}):
            problem = f"it holds files no export made: {', '.join(extra[:5])}"
    if problem:
        raise ForeignPathError(
            f"{out} is not an earlier export of dcp-tiered ({problem}): --force replaces only "
            "that, so it was left untouched and nothing was written. Give another OUT"
        )


def _publish(tmp: str, out: str) -> None:
    """Rename the finished export into place. A replaced OUT (--force, an earlier export of
    ours: checked again now) is moved aside first and deleted (logged) only once the new one
    is in place; a failed rename puts it back."""
    old = None
    if os.path.lexists(out):
        _require_export(out)
        old = f"{tmp}.replaced"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        logger.info("deleting %s (the export it held was replaced: --force)", out)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.remove(old)
