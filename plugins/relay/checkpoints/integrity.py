"""File integrity in one pass over the mapped file (in segments, on every core given a pool): the size,
the CRC64NVME of every byte (what S3 records as a full-object checksum, so a published object is compared
with its manifest directly), and, for a .pt file, the CRC32 of every zip entry (torch.load alone accepts
altered tensor bytes; the zip does not). Given the dtypes of a .pt file's floating-point storages (zip
entries), the same pass also tells which of them hold NaN or Inf, so validation reads each byte once.
"""

from __future__ import annotations

import base64
import bisect
import math
import mmap
import os
import struct
import threading
import zipfile
import zlib
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from awscrt import checksums

try:  # ISA-L's CRC-32: zlib's polynomial and results, about five times zlib's speed here (requirements.txt)
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # a cluster image without it: zlib's, slower, the same checksums
    _crc32 = zlib.crc32

SEGMENT = 32 << 20  # what one thread checksums at a time: a few segments per core even for a 100 MB file
# Within a segment, every check runs over one block before the next block is read: the block is still in the
# core's cache when the second and third checks read it (a 32 MiB segment is not), so each byte comes from
# memory once.
BLOCK = 1 << 20


@dataclass
class FileScan:
    size: int
    crc64nvme: str  # base64 of the big-endian CRC64NVME, as S3 reports ChecksumCRC64NVME
    problem: str | None = None  # why the file is not whole, if it is not
    # Of the entries given to scan(finite=...): those whose values hold NaN or Inf (or, in float32 and float64,
    # sum past the dtype's range; or whose dtype it cannot read). Empty when none, or when none were given.
    nonfinite: list[str] = field(default_factory=list)


def crc64nvme_b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(8, "big")).decode()


def crc64nvme_bytes(data: bytes, previous: int = 0) -> int:
    crc: int = checksums.crc64nvme(data, previous)
    return crc


def zip_entries(path: Path) -> list[tuple[str, int, int, int]]:
    """(name, data offset, size, CRC32) of each stored entry; torch writes its .pt zips uncompressed."""
    entries = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                raise zipfile.BadZipFile(f"entry {info.filename} is compressed; torch writes stored entries")
            f.seek(info.header_offset)
            header = f.read(30)
            if header[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"bad local header for entry {info.filename}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            entries.append((info.filename, info.header_offset + 30 + name_len + extra_len, info.file_size, info.CRC))
    return entries


def scan(
    path: Path, *, zip_crc: bool | None = None, pool: Executor | None = None, finite: dict[int, str] | None = None
) -> FileScan:
    """Read `path` once: size and CRC64NVME always; per-entry CRC32 for .pt files (or when zip_crc); with
    `finite` (a zip entry's data offset -> the name of the torch dtype of its values, e.g. "bfloat16"), whether
    those entries' values are all finite.

    The file is mapped (no copy into Python) and cut into segments of SEGMENT bytes; each segment feeds the
    whole-file CRC64NVME and the CRC32 of the zip entries it overlaps, and the segments' checksums are combined
    in order (awscrt's combine_crc64nvme, combine_crc32: zlib's CRC-32). With a pool the segments are
    checked in parallel: ISA-L (or zlib), awscrt and numpy release the GIL, so the checks use every core, even for
    a checkpoint whose size is in one or two files."""

    path = Path(path)
    check_zip = path.suffix == ".pt" if zip_crc is None else zip_crc
    problem = None
    entries: list[tuple[str, int, int, int]] = []
    if check_zip or finite:
        try:
            entries = zip_entries(path)
        except (zipfile.BadZipFile, OSError, struct.error) as e:
            problem = f"not a complete torch (zip) file: {e}; it may be truncated"
    entries.sort(key=lambda e: e[1])
    dtypes = [(finite or {}).get(off) for _, off, _, _ in entries]
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return FileScan(0, crc64nvme_b64(0), problem or _past_end(entries, 0))
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if hasattr(mmap, "MADV_SEQUENTIAL"):
                mm.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(mm)
            try:
                spans = [(lo, min(lo + SEGMENT, size)) for lo in range(0, size, SEGMENT)]
                ends = [off + length for _, off, length, _ in entries]  # sorted, as the entries are
                parts = list((pool.map if pool else map)(lambda span: _segment(view, span, entries, ends, dtypes), spans))
            finally:
                view.release()
    crc64 = 0
    entry_crc: list[int | None] = [None] * len(entries)
    nonfinite: set[int] = set()
    for (lo, hi), (seg_crc64, seg_entries, seg_nonfinite) in zip(spans, parts, strict=False):
        crc64 = checksums.combine_crc64nvme(crc64, seg_crc64, hi - lo) if lo else seg_crc64
        for i, crc, n in seg_entries:
            entry_crc[i] = crc if entry_crc[i] is None else checksums.combine_crc32(entry_crc[i], crc, n)
        nonfinite |= seg_nonfinite
    if problem is None:
        problem = _past_end(entries, size)
    if problem is None and check_zip:
        for (name, _, _length, want), got in zip(entries, entry_crc, strict=False):
            if (got if got is not None else 0) != want:
                problem = f"entry {name} fails its CRC32 check (the bytes were altered)"
                break
    return FileScan(size, crc64nvme_b64(crc64), problem, [entries[i][0] for i in sorted(nonfinite)])


def _segment(
    view: memoryview,
    span: tuple[int, int],
    entries: list[tuple[str, int, int, int]],
    ends: list[int],
    dtypes: list[str | None],
) -> tuple[int, list[tuple[int, int, int]], set[int]]:
    """(CRC64NVME of view[lo:hi], [(entry index, CRC32 of the entry's bytes in the segment, their length)],
    {index of an entry with a dtype whose values in the segment are not all finite}), block by block."""
    lo, hi = span
    crc64, crc32, nonfinite = 0, dict[int, int](), set[int]()
    first = bisect.bisect_right(ends, lo)  # the first entry that ends past the segment's start
    with np.errstate(over="ignore", invalid="ignore"):  # a sum's overflow is _all_finite's answer, not a warning
        for b_lo in range(lo, hi, BLOCK):
            b_hi = min(b_lo + BLOCK, hi)
            block = view[b_lo:b_hi]
            try:
                crc64 = checksums.crc64nvme(block, crc64)
                for i in range(first, len(entries)):
                    _, off, length, _ = entries[i]
                    if off >= b_hi:
                        break
                    a, b = max(off, b_lo), min(off + length, b_hi)
                    if a >= b:
                        continue
                    part = block[a - b_lo : b - b_lo]
                    try:
                        crc32[i] = _crc32(part, crc32.get(i, 0))
                        if (dtype := dtypes[i]) is not None and i not in nonfinite and not _all_finite(part, dtype):
                            nonfinite.add(i)
                    finally:
                        part.release()
            finally:
                block.release()
    return crc64, [(i, crc, min(ends[i], hi) - max(entries[i][1], lo)) for i, crc in crc32.items()], nonfinite


# The values' check, per dtype. float32 and float64: numpy's sum, one read, NaN or Inf when any value is (a sum of
# finite values that overflows reads as not finite: the caller's tensor-by-tensor check tells it apart). float16
# and bfloat16 (no numpy type; a float16 sum overflows at 65504): a value is NaN or Inf exactly when its exponent
# bits are all ones, one mask and one max over the values' integer view. numpy releases the GIL and, unlike
# torch's reductions, runs on the calling thread only: the pool's threads already use every core.
SUMMED = {"float32": np.float32, "float64": np.float64}
EXPONENT_BITS = {"float16": (np.int16, 0x7C00), "bfloat16": (np.int16, 0x7F80)}
_scratch = threading.local()


def _all_finite(part: memoryview, dtype: str) -> bool:
    """Are the values in `part` (whole elements of the torch dtype named `dtype`: entries start 64-byte aligned,
    blocks on multiples of BLOCK) all finite? False also for a dtype it cannot read: the caller checks those
    tensor by tensor."""
    if dtype in SUMMED:
        if len(part) % np.dtype(SUMMED[dtype]).itemsize:
            return False
        return math.isfinite(float(np.frombuffer(part, SUMMED[dtype]).sum()))  # (_segment silences the overflow)
    kind = EXPONENT_BITS.get(dtype)
    if kind is None or len(part) % 2:
        return False
    ints = np.frombuffer(part, kind[0])
    out = getattr(_scratch, "buf", None)  # a buffer per thread: a fresh one per block would fault in its pages
    if out is None or out.nbytes < BLOCK:
        out = _scratch.buf = np.empty(BLOCK, np.uint8)
    masked = out[: ints.nbytes].view(kind[0])
    np.bitwise_and(ints, kind[1], out=masked)
    return int(masked.max()) != kind[1]


def _past_end(entries: list[tuple[str, int, int, int]], size: int) -> str | None:
    for name, off, length, _ in entries:
        if off + length > size:
            return f"entry {name} runs past the end of the file; the file is truncated"
    return None
