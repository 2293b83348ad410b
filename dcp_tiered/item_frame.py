"""Each tensor item as torch.save writes it, framed from a template instead of serialised.

A tensor item of a step is a whole ``torch.save`` archive (a zip of ``data.pkl``, a few constant
records, the tensor's bytes in ``data/0``), so that DCP's vanilla ``FileSystemReader`` reads our
steps. Running torch's writer costs about 60 µs and 39 small stream writes per item, which is
most of a save of many small tensors. Everything in such an archive but the tensor's bytes
depends only on its dtype, shape and stride, so this module builds the bytes before the data
(``head``) and after it (``tail``) from templates, and the writer sends the tensor's own memory
between them.

Byte identity with torch's writer rests on details torch does not promise (record order,
padding, the pickle's opcodes). So nothing is assumed: the first time a dtype is framed in this
process, frames of a few probe tensors are compared byte for byte with torch's own output, and
a dtype whose frames differ is never framed (the writer falls back to torch's writer for it,
as it does for any tensor not plain, dense, CPU, contiguous and under 4 GiB). The zip CRCs stay
zero, as with the writer dcp_tiered used before (``_torch_compat.save_tensor``): torch.load does
not check them, and every item is CRC32C-checked against the manifest.
"""

from __future__ import annotations

import io
import logging
import pickle
import pickletools
import struct
import threading
import zipfile
from typing import NamedTuple

import torch

from . import _torch_compat

logger = logging.getLogger(__name__)

# Below the zip64 thresholds: a larger tensor's archive has other framing (torch's writer then).
MAX_FRAMED_BYTES = 2**32 - 2**20
_DATA = "data/0"
_PKL = "data.pkl"


class Frame(NamedTuple):
    """An item's bytes are ``head``, the tensor's ``nbytes`` bytes, ``tail``."""

    head: bytes
    tail: bytes


class _Record(NamedTuple):
    name: bytes  # with the archive's prefix, as stored
    content: bytes | None  # None for data.pkl and the tensor's data


class _Template:
    """Torch's archive layout as this torch writes it, learnt from one probe archive."""

    def __init__(self, archive: bytes) -> None:
        infos = _records(archive)
        self.records: list[_Record] = []
        for name, content in infos:
            short = name.split("/", 1)[1] if "/" in name else name
            self.records.append(_Record(name.encode(), None if short in (_PKL, _DATA) else content))
        shorts = [r.name.decode().split("/", 1)[-1] for r in self.records]
        if shorts.count(_PKL) != 1 or shorts.count(_DATA) != 1:
            raise ValueError(f"unexpected records {shorts}")
        self.pkl_index, self.data_index = shorts.index(_PKL), shorts.index(_DATA)
        if self.pkl_index != 0 or self.data_index == 0:
            raise ValueError(f"unexpected record order {shorts}")
        # where data.pkl's bytes start: after its local header (fixed: no sizes, a set name)
        self.pkl_at = 30 + len(self.records[0].name) + 4
        self.pkl_at += -self.pkl_at % _torch_compat.storage_alignment()
        self.alignment = _torch_compat.storage_alignment()

    def build(self, pkl: bytes, nbytes: int) -> tuple[bytes, bytes, list[tuple[int, str, int]]]:
        """(head, tail, fields of the tail that grow with ``nbytes``: (position, struct
        format, value minus nbytes))."""
        out = bytearray()
        grows: list[tuple[int, str, int]] = []  # positions in `out`
        central = bytearray()
        central_grows: list[tuple[int, str, int]] = []
        data_at = -1
        offset = 0  # the archive's own offset (out excludes the tensor's bytes)
        for i, rec in enumerate(self.records):
            size = len(pkl) if i == self.pkl_index else nbytes if i == self.data_index else None
            if size is None:
                assert rec.content is not None
                size = len(rec.content)
            after_data = i > self.data_index
            start = offset + 30 + len(rec.name) + 4
            pad = -start % self.alignment
            flags = 0x0808 if size else 0x0800
            record_at = offset
            out += struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, flags, 0, 0, 0, 0, 0, 0,
                               len(rec.name), 4 + pad)  # fmt: skip
            out += rec.name + b"FB" + struct.pack("<H", pad) + b"Z" * pad
            offset += 30 + len(rec.name) + 4 + pad
            if i == self.data_index:
                data_at = len(out)
            elif i == self.pkl_index:
                out += pkl
            else:
                assert rec.content is not None  # a constant record
                out += rec.content
            offset += size
            if size:
                if i == self.data_index:
                    grows += [(len(out) + 8, "<I", 0), (len(out) + 12, "<I", 0)]
                out += struct.pack("<IIII", 0x08074B50, 0, size, size)
                offset += 16
            cd_at = len(central)
            central += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, flags, 0, 0, 0, 0,
                                   size, size, len(rec.name), 0, 0, 0, 0, 0, record_at)  # fmt: skip
            central += rec.name
            if i == self.data_index:
                central_grows += [(cd_at + 20, "<I", 0), (cd_at + 24, "<I", 0)]
            elif after_data:
                central_grows.append((cd_at + 42, "<I", record_at - nbytes))
        cd_offset, count = offset, len(self.records)
        zip64_at = cd_offset + len(central)
        central_at = len(out)
        grows += [(central_at + p, f, v) for p, f, v in central_grows]
        out += central
        grows.append((len(out) + 48, "<Q", cd_offset - nbytes))
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, count, count,
                           len(central), cd_offset)  # fmt: skip
        grows.append((len(out) + 8, "<Q", zip64_at - nbytes))
        out += struct.pack("<IIQI", 0x07064B50, 0, zip64_at, 1)
        grows.append((len(out) + 16, "<I", cd_offset - nbytes))
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, len(central), cd_offset, 0)
        head, tail = bytes(out[:data_at]), bytes(out[data_at:])
        return head, tail, [(p - data_at, f, v) for p, f, v in grows]


def _records(archive: bytes) -> list[tuple[str, bytes]]:
    """(name, stored bytes) of each record of a torch.save archive, in order. Read through the
    local headers: zipfile's own reads would check the CRCs, which this writer leaves zero."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        infos = sorted(z.infolist(), key=lambda i: i.header_offset)
    out = []
    for info in infos:
        name_len, extra_len = struct.unpack_from("<HH", archive, info.header_offset + 26)
        at = info.header_offset + 30 + name_len + extra_len
        out.append((info.filename, archive[at : at + info.file_size]))
    return out


def _pickle_int(value: int) -> bytes:
    """The opcode CPython's pickler (protocol 2) writes for ``value``: the reference itself."""
    return pickle.dumps(value, protocol=2)[2:-1]


def _memo(n: int) -> bytes:
    return b"q" + bytes([n]) if n < 256 else b"r" + struct.pack("<I", n)


def _tuple(values: tuple[int, ...], memo: int) -> tuple[bytes, int]:
    """A tuple of ints as the pickler writes it, and the next memo slot."""
    if not values:
        return b")", memo
    body = b"".join(_INTS.get(v) or _pickle_int(v) for v in values)
    if len(values) <= 3:
        return body + b"\x85\x86\x87"[len(values) - 1 : len(values)] + _memo(memo), memo + 1
    return b"(" + body + b"t" + _memo(memo), memo + 1


_INTS = {v: _pickle_int(v) for v in range(4096)}


class _DtypePickle:
    """``data.pkl`` of a tensor of one dtype: the bytes before the storage's element count are
    torch's own (from a probe), the rest is written as the pickler writes it."""

    def __init__(self, dtype: torch.dtype, probe_pkl: bytes) -> None:
        ops = list(pickletools.genops(probe_pkl))
        first_int = next(
            i for i, (op, _, _) in enumerate(ops) if op.name in ("BININT1", "BININT2", "BININT")
        )
        self.prefix = probe_pkl[: ops[first_int][2]]
        self.untyped = b"_rebuild_tensor_v3" in self.prefix
        self.dtype_global = b""
        if self.untyped:
            self.dtype_global = b"ctorch\n" + str(dtype).removeprefix("torch.").encode() + b"\n"
        self.itemsize = dtype.itemsize

    def encode(self, shape: tuple[int, ...], stride: tuple[int, ...], numel: int) -> bytes:
        count = numel * self.itemsize if self.untyped else numel
        shape_b, memo = _tuple(shape, 6)
        stride_b, memo = _tuple(stride, memo)
        parts = [
            self.prefix,
            _INTS.get(count) or _pickle_int(count),
            b"t" + _memo(5) + b"QK\x00",  # the persistent id, storage offset 0
            shape_b,
            stride_b,
            b"\x89ccollections\nOrderedDict\n" + _memo(memo) + b")R" + _memo(memo + 1),
        ]
        memo += 2
        if self.untyped:
            parts.append(self.dtype_global + _memo(memo))
            memo += 1
        parts.append(b"t" + _memo(memo) + b"R" + _memo(memo + 1) + b".")
        return b"".join(parts)


def _torch_bytes(tensor: torch.Tensor) -> bytes:
    out = io.BytesIO()
    _torch_compat.save_tensor(tensor, out)
    return out.getvalue()


def _probes(dtype: torch.dtype) -> list[torch.Tensor]:
    """Tensors whose frames must equal torch's before ``dtype`` is framed: 0-d, empty, sizes
    either side of the alignment, counts that take each int opcode, more than 3 dimensions,
    and a unit dimension with an unusual stride (still contiguous)."""
    shapes = [(), (0,), (1,), (3, 5), (63,), (65,), (257, 3), (2, 1, 3, 1, 2), (70000,)]
    # zero bytes: the probes' contents are the same on every run
    out = [
        torch.zeros(_bytes(shape, dtype), dtype=torch.uint8).view(dtype).view(shape)
        for shape in shapes
    ]
    out.append(
        torch.zeros(_bytes((3,), dtype), dtype=torch.uint8).view(dtype).as_strided((3, 1), (1, 7))
    )
    return out


def _bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


class Framer:
    """Frames tensor items; thread-safe. One per process (see :data:`FRAMER`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # by whether the tensor is empty: the serialisation id folds in one value per
        # non-empty record, so it differs between the two
        self._templates: dict[bool, _Template] = {}
        self._broken = False  # this torch's writer is not what the templates expect
        self._dtypes: dict[torch.dtype, _DtypePickle | None] = {}
        # (L, nbytes % alignment, nbytes == 0) -> (the head after data.pkl, tail, fields)
        self._skeletons: dict[
            tuple[int, int, bool], tuple[bytes, bytes, bytes, list[tuple[int, str, int]]]
        ] = {}
        self._frames: dict[tuple[torch.dtype, tuple[int, ...], tuple[int, ...]], Frame] = {}

    def frame(self, tensor: torch.Tensor) -> Frame | None:
        """``tensor``'s head and tail, or None: write it with torch's writer. ``tensor`` must
        be contiguous with a storage of exactly its bytes
        (:func:`dcp_tiered.item_writer.as_saveable`)."""
        if not _plain(tensor):
            return None
        key = (tensor.dtype, tuple(tensor.shape), tensor.stride())
        found = self._frames.get(key)
        if found is not None:
            return found
        coder = self._dtype(tensor.dtype)
        if (
            coder is None
            or tensor.numel() * tensor.element_size() >= MAX_FRAMED_BYTES
            or _torch_compat.tensor_metadata(tensor)
        ):
            return None
        made = self._make(coder, key[1], key[2], tensor.numel())
        if len(self._frames) > 200_000:  # a bound, not a policy: states rarely have more
            self._frames.clear()
        self._frames[key] = made
        return made

    def _make(
        self, coder: _DtypePickle, shape: tuple[int, ...], stride: tuple[int, ...], numel: int
    ) -> Frame:
        """From the skeleton of archives of the same pickle length and data size modulo the
        alignment (the same padding everywhere): the pickle set in, the sizes and offsets
        after the data moved by the data's size."""
        pkl = coder.encode(shape, stride, numel)
        nbytes = numel * coder.itemsize
        template = self._templates[nbytes == 0]
        key = (len(pkl), nbytes % template.alignment, nbytes == 0)
        skeleton = self._skeletons.get(key)
        if skeleton is None:
            head, tail, grows = template.build(pkl, nbytes)
            # data.pkl is the first record: its header says nothing of its length or bytes
            at = template.pkl_at
            skeleton = (head[:at], head[at + len(pkl) :], tail, grows)
            self._skeletons[key] = skeleton
            return Frame(head, tail)
        before, after, tail_template, grows = skeleton
        patched = bytearray(tail_template)
        for pos, fmt, base in grows:
            struct.pack_into(fmt, patched, pos, base + nbytes)
        return Frame(before + pkl + after, bytes(patched))

    def _dtype(self, dtype: torch.dtype) -> _DtypePickle | None:
        if dtype in self._dtypes:
            return self._dtypes[dtype]
        with self._lock:
            if dtype not in self._dtypes:
                self._dtypes[dtype] = self._checked(dtype)
            return self._dtypes[dtype]

    def _checked(self, dtype: torch.dtype) -> _DtypePickle | None:
        """The dtype's pickle coder if its frames equal torch's own bytes for every probe."""
        if self._broken:
            return None
        try:
            if not self._templates:
                for empty in (False, True):
                    probe = torch.zeros(0 if empty else 3, dtype=torch.float32)
                    self._templates[empty] = _Template(_torch_bytes(probe))
            probe = torch.zeros(1, dtype=dtype)
            pkl = next(c for n, c in _records(_torch_bytes(probe)) if n.endswith("/" + _PKL))
            coder = _DtypePickle(dtype, pkl)
            for t in _probes(dtype):
                made = self._make(coder, tuple(t.shape), t.stride(), t.numel())
                own = _torch_bytes(t)
                mine = made.head + _bytes_of(t) + made.tail
                if own != mine:
                    raise ValueError(f"frame of {dtype} {tuple(t.shape)} differs from torch's")
        except Exception as e:  # noqa: BLE001 - any surprise means: use torch's writer
            if len(self._templates) < 2:
                self._broken = True
            logger.info("tensors of %s are written with torch's own writer: %s", dtype, e)
            self._skeletons.clear()
            return None
        return coder


def _plain(t: torch.Tensor) -> bool:
    """A dense CPU tensor of the plain class, without a conjugate or negative bit (what
    torch.save would record as metadata), starting at its storage's first byte."""
    return (
        type(t) is torch.Tensor
        and t.layout == torch.strided
        and not t.is_conj()
        and not t.is_neg()
        and not t.is_nested
        and not t.requires_grad
        and t.device.type == "cpu"
        and t.storage_offset() == 0
    )


def _bytes_of(t: torch.Tensor) -> bytes:
    if t.numel() == 0:
        return b""
    return bytes(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


FRAMER = Framer()
