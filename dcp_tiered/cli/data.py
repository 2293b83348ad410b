"""The CLI's commands that read a step's data or its remote copy: ``diff`` and
``verify --remote`` (``export`` is in :mod:`dcp_tiered.cli.export`). Data is read through
:class:`StepItems` (the reader's verified path), a batch of tensors at a time, never a whole
step."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..errors import CheckpointNotFoundError, ManifestError
from ..policy import layout
from ..tiers import catalog, verify
from ..tiers.remote import RemoteTier
from ._base import OK, PROBLEM, human
from ._context import Run, progress
from ._items import StepItems

_COMPARE_ELEMENTS = 2**22  # elements compared at once: bounds the temporaries of a comparison


def _describe(md: Any) -> dict[str, Any]:
    if isinstance(md, TensorStorageMetadata):
        return {
            "kind": "tensor",
            "dtype": str(md.properties.dtype).removeprefix("torch."),
            "shape": list(md.size),
        }
    return {"kind": "bytes"}


def compare(x: torch.Tensor, y: torch.Tensor) -> tuple[int, float | None, int]:
    """(elements whose bits differ, the largest finite |x - y| among them or None, how many
    of them differ by a non-finite amount: NaN or inf on one side). Bitwise, so a NaN saved
    twice is the same and 0.0 vs -0.0 differs. Same shape and dtype."""
    fx, fy = x.reshape(-1), y.reshape(-1)
    width = x.element_size()
    differing, nonfinite, largest = 0, 0, None
    for start in range(0, fx.numel(), _COMPARE_ELEMENTS):
        a, b = fx[start : start + _COMPARE_ELEMENTS], fy[start : start + _COMPARE_ELEMENTS]
        bits_a, bits_b = a.view(torch.uint8).view(-1, width), b.view(torch.uint8).view(-1, width)
        mask = (bits_a != bits_b).any(dim=1)
        count = int(mask.sum())
        if not count:
            continue
        differing += count
        da, db = a[mask], b[mask]
        if da.is_complex():
            delta = (da.to(torch.complex128) - db.to(torch.complex128)).abs()
        elif da.dtype == torch.bool:
            delta = (da != db).double()
        else:
            delta = (da.double() - db.double()).abs()
        finite = torch.isfinite(delta)
        nonfinite += int((~finite).sum())
        if bool(finite.any()):
            top = float(delta[finite].max())
            largest = top if largest is None else max(largest, top)
    return differing, largest, nonfinite


def cmd_diff(run: Run) -> int:
    """Which items of two steps differ, and by how much. Exit 0: identical; 1: they differ."""
    ma, source_a = catalog.step_manifest(run.tier, run.remote(), run.args.step_a)
    mb, source_b = catalog.step_manifest(run.tier, run.remote(), run.args.step_b)
    remote = run.remote()
    config = remote.config if remote is not None else None
    a = StepItems(run.tier.root, ma.step, config)
    b = StepItems(run.tier.root, mb.step, config)
    meta_a, meta_b = ma.metadata.state_dict_metadata, mb.metadata.state_dict_metadata
    entries: dict[str, dict[str, Any]] = {}
    same_layout: list[str] = []  # tensors of one shape and dtype in both: compared element-wise
    for fqn in sorted(set(meta_a) | set(meta_b)):
        if fqn not in meta_b:
            entries[fqn] = {"fqn": fqn, "status": "only-in-a", **_describe(meta_a[fqn])}
            continue
        if fqn not in meta_a:
            entries[fqn] = {"fqn": fqn, "status": "only-in-b", **_describe(meta_b[fqn])}
            continue
        da, db = _describe(meta_a[fqn]), _describe(meta_b[fqn])
        entry: dict[str, Any] = {"fqn": fqn, "kind": da["kind"]}
        if da["kind"] != db["kind"]:
            entry.update(status="different", reason="kind", kind_b=db["kind"])
        elif da["kind"] == "bytes":
            same = a.raw_bytes(fqn) == b.raw_bytes(fqn)
            entry.update(status="same" if same else "different", reason=None if same else "bytes")
        else:
            entry.update(dtype=da["dtype"], shape=da["shape"])
            if (da["dtype"], da["shape"]) != (db["dtype"], db["shape"]):
                reason = "dtype" if da["dtype"] != db["dtype"] else "shape"
                entry.update(
                    status="different", reason=reason, dtype_b=db["dtype"], shape_b=db["shape"]
                )
            else:
                same_layout.append(fqn)
        entries[fqn] = entry
    total = sum(
        2 * math.prod(md.size) * md.properties.dtype.itemsize
        for fqn in same_layout
        if isinstance(md := meta_a[fqn], TensorStorageMetadata)
    )
    with progress(total, f"diff {ma.step} {mb.step}", run) as bar:
        for (fqn, x), (_, y) in zip(a.tensors(same_layout), b.tensors(same_layout)):
            differing, largest, nonfinite = compare(x, y)
            entries[fqn].update(
                status="different" if differing else "same",
                reason="values" if differing else None,
                numel=x.numel(),
                differing=differing,
                max_abs_diff=largest,
                nonfinite_diffs=nonfinite,
            )
            bar.update(2 * x.nbytes)
            del x, y
    items = list(entries.values())
    counts = {s: sum(e["status"] == s for e in items) for s in ("same", "different")}
    counts["only_in_a"] = sum(e["status"] == "only-in-a" for e in items)
    counts["only_in_b"] = sum(e["status"] == "only-in-b" for e in items)
    identical = counts["same"] == len(items)
    run.fields.update(
        step_a=ma.step,
        step_b=mb.step,
        source_a=source_a,
        source_b=source_b,
        identical=identical,
        summary=counts,
        items=items,
    )
    for e in items:
        if e["status"] == "same":
            continue
        if e["status"] != "different":
            run.say(f"{e['fqn']}: {e['status']}")
        elif e["reason"] == "values":
            worst = "-" if e["max_abs_diff"] is None else f"{e['max_abs_diff']:.6g}"
            extra = f", {e['nonfinite_diffs']} non-finite" if e["nonfinite_diffs"] else ""
            run.say(
                f"{e['fqn']}: {e['differing']} of {e['numel']} elements differ, "
                f"max |a-b| {worst}{extra}"
            )
        elif e["reason"] in ("dtype", "shape"):
            run.say(f"{e['fqn']}: {e['dtype']} {e['shape']} -> {e['dtype_b']} {e['shape_b']}")
        else:
            run.say(f"{e['fqn']}: different ({e['reason']})")
    run.say(
        f"{ma.step} vs {mb.step}: {counts['same']} same, {counts['different']} different, "
        f"{counts['only_in_a']} only in {ma.step}, {counts['only_in_b']} only in {mb.step}"
    )
    return OK if identical else PROBLEM


def cmd_verify_remote(run: Run) -> int:
    """Check the remote copy of steps: every data file there, with the manifest's size and
    CRC32C (:func:`dcp_tiered.tiers.verify.remote_files`: by the checksum the store recorded
    at upload where it keeps one, else, or with ``--read-back``, of the bytes read back)."""
    args = run.args
    url, step = args.remote or None, args.step
    if url is not None and "://" not in url and step is None:
        url, step = None, url  # `verify ROOT --remote step-7`: a bare name is the step
        args.remote = ""  # so Run.remote() takes the recorded URL, not the step name
    remote = run.need_remote(url)
    if step is None:
        steps = RemoteTier(remote).steps()
    elif step == layout.LATEST:
        steps = [catalog.remote_latest_step(remote)]
    else:
        steps = [layout.validate_step_name(step)]
    results = []
    for name in steps:
        try:
            m, keys = catalog.remote_manifest(remote, name)
        except (ManifestError, FileNotFoundError) as e:  # this step only
            if step is not None and isinstance(e, CheckpointNotFoundError):
                raise  # named, and not committed there: a wrong URL or name, not a bad copy
            why = f"{type(e).__name__}: {e}"
            results.append({"step": name, "tier": "remote", "ok": False, "problems": [why]})
            run.say(f"{name} on {remote.config.url}: CORRUPT\n  {why}")
            continue
        total = sum(int(f["size"]) for f in m.files.values())
        with progress(total, f"verify {name}", run) as bar:
            check = verify.remote_files(
                remote, keys, m, read_back=args.read_back, progress=bar.update
            )
        problems, checked, read_bytes = check.problems, check.checked, check.bytes_read
        results.append(
            {
                "step": name,
                "tier": "remote",
                "ok": not problems,
                "problems": problems,
                "files": len(m.files),
                "bytes": total,
                "checked": checked,
                "bytes_read": read_bytes,
            }
        )
        how = (
            f"{checked['recorded']} by the checksum the store recorded at upload (no download), "
            f"{checked['read']} read back ({human(read_bytes)})"
        )
        if checked["read"] and not args.read_back:
            how += ": the store keeps no checksum for those, so they were read in full"
        state = "OK" if not problems else "CORRUPT\n  " + "\n  ".join(problems)
        run.say(f"{name} on {remote.config.url}: {state}\n  {len(m.files)} files: {how}")
    run.fields["steps"] = results
    return PROBLEM if any(not r["ok"] for r in results) else OK
