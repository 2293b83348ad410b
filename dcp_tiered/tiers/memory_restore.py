"""A memory-tier snapshot checked and loaded into a state: its chunks (or, in version 1
headers, its tensors) verified against the header, then every tensor paired with the state's
and copied in one batch. The memory tier's own restores and the peer replicas' use it."""

from __future__ import annotations

from typing import Any

import torch

from .. import host_copy
from ..errors import IntegrityError
from ..policy import memory_chunks, memory_fill
from ..policy import memory_format as fmt


def verify(header: fmt.Header, buffer: torch.Tensor, where: str) -> None:
    """Raises IntegrityError unless ``buffer`` matches the header's checksums (of its chunks,
    or of each tensor in version-1 headers)."""
    if buffer.numel() < header.data_size:
        raise IntegrityError(f"{where}: {buffer.numel()} bytes, the header says {header.data_size}")
    if header.chunk_bytes:
        for chunk, expected in enumerate(header.chunk_checksums):
            got = memory_chunks.checksum(
                buffer, chunk, header.chunk_bytes, header.data_size, header.chunk_algorithm
            )
            if got != expected:
                start = chunk * header.chunk_bytes
                end = min(start + header.chunk_bytes, header.data_size)
                hit = [
                    r.key for r in header.regions if r.offset < end and r.offset + r.nbytes > start
                ]
                raise IntegrityError(
                    f"{where}: the chunk of bytes {start}-{end} (tensors {hit[:5]}"
                    f"{' ...' if len(hit) > 5 else ''}) fails its checksum"
                )
        return
    actual = fmt.region_checksums(buffer, header.regions)
    for region, expected, got in zip(header.regions, header.checksums, actual):
        if got != expected:
            raise IntegrityError(f"{where}: {region.key} fails its checksum")


def fill_state(
    header: fmt.Header,
    buffer: torch.Tensor,
    app_state: dict[str, Any],
    where: str,
    *,
    allow_pickle: bool = False,
) -> None:
    """Load a verified snapshot into ``app_state`` (Stateful objects get ``load_state_dict``)."""
    tensors = {r.key: v for r, v in zip(header.regions, fmt.views(buffer, header.regions))}
    objects = fmt.decode_objects(header.objects, allow_pickle=allow_pickle, where=where)
    for name, value in app_state.items():
        stateful = hasattr(value, "state_dict") and hasattr(value, "load_state_dict")
        filled, pairs = memory_fill.fill(
            value.state_dict() if stateful else value, tensors, objects, where, (name,)
        )
        host_copy.copy_all([d for d, _ in pairs], [s for _, s in pairs])
        if stateful:
            value.load_state_dict(filled)
        else:
            app_state[name] = filled
