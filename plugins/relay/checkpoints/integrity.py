"""File integrity in one pass over the mapped file (in segments, on every core given a pool): the size,
the CRC64NVME of every byte (what S3 records as a full-object checksum, so a published object is compared
with its manifest directly), and, for a .pt file, the CRC32 of every zip entry (torch.load alone accepts
altered tensor bytes; the zip does not).
"""

from __future__ import annotations

import base64
import bisect
import mmap
import os
import struct
import zipfile
import zlib
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

from awscrt import checksums

SEGMENT = 32 << 20  # what one thread checksums at a time: a few segments per core even for a 100 MB file


@dataclass
class FileScan:
    size: int
    crc64nvme: str  # base64 of the big-endian CRC64NVME, as S3 reports ChecksumCRC64NVME
    problem: str | None = None  # why the file is not whole, if it is not


def crc64nvme_b64(value: int) -> str:
    return base64.b64encode(value.to_bytes(8, "big")).decode()


def crc64nvme_bytes(data: bytes, previous: int = 0) -> int:
    return checksums.crc64nvme(data, previous)


def _zip_entries(path: Path) -> list[tuple[str, int, int, int]]:
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


def scan(path: Path, *, zip_crc: bool | None = None, pool: Executor | None = None) -> FileScan:
    """Read `path` once: size and CRC64NVME always; per-entry CRC32 for .pt files (or when zip_crc).

    The file is mapped (no copy into Python) and cut into segments of SEGMENT bytes; each segment feeds the
    whole-file CRC64NVME and the CRC32 of the zip entries it overlaps, and the segments' checksums are combined
    in order (awscrt's combine_crc64nvme, combine_crc32: zlib's CRC-32). With a pool the segments are
    checksummed in parallel: zlib and awscrt release the GIL, so the CRC32 that bounds validation uses every
    core, even for a checkpoint whose size is in one or two files."""

    path = Path(path)
    check_zip = path.suffix == ".pt" if zip_crc is None else zip_crc
    problem = None
    entries: list = []
    if check_zip:
        try:
            entries = _zip_entries(path)
        except (zipfile.BadZipFile, OSError, struct.error) as e:
            problem = f"not a complete torch (zip) file: {e}; it may be truncated"
    entries.sort(key=lambda e: e[1])
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
                parts = list((pool.map if pool else map)(lambda span: _segment(view, span, entries, ends), spans))
            finally:
                view.release()
    crc64 = 0
    entry_crc: list[int | None] = [None] * len(entries)
    for (lo, hi), (seg_crc64, seg_entries) in zip(spans, parts):
        crc64 = checksums.combine_crc64nvme(crc64, seg_crc64, hi - lo) if lo else seg_crc64
        for i, crc, n in seg_entries:
            entry_crc[i] = crc if entry_crc[i] is None else checksums.combine_crc32(entry_crc[i], crc, n)
    if problem is None:
        problem = _past_end(entries, size)
    if problem is None:
        for (name, _, length, want), got in zip(entries, entry_crc):
            if (got if got is not None else 0) != want:
                problem = f"entry {name} fails its CRC32 check (the bytes were altered)"
                break
    return FileScan(size, crc64nvme_b64(crc64), problem)


def _segment(view: memoryview, span: tuple[int, int], entries: list,
             ends: list[int]) -> tuple[int, list[tuple[int, int, int]]]:
    """(CRC64NVME of view[lo:hi], [(entry index, CRC32 of the entry's bytes in the segment, their length)])."""
    lo, hi = span
    seg = view[lo:hi]
    try:
        crc64 = checksums.crc64nvme(seg)
        out = []
        first = bisect.bisect_right(ends, lo)  # the first entry that ends past the segment's start
        for i in range(first, len(entries)):
            _, off, length, _ = entries[i]
            if off >= hi:
                break
            a, b = max(off, lo), min(off + length, hi)
            if a < b:
                out.append((i, zlib.crc32(seg[a - lo:b - lo]), b - a))
        return crc64, out
    finally:
        seg.release()


def _past_end(entries: list, size: int) -> str | None:
    for name, off, length, _ in entries:
        if off + length > size:
            return f"entry {name} runs past the end of the file; the file is truncated"
    return None
