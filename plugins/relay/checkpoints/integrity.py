"""File integrity in one sequential read: the size, the CRC64NVME of every byte (what S3 records as a
full-object checksum, so a published object is compared with its manifest directly), and, for a .pt
file, the CRC32 of every zip entry (torch.load alone accepts altered tensor bytes; the zip does not).
"""

from __future__ import annotations

import base64
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from awscrt import checksums

BLOCK = 8 << 20


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


def scan(path: Path, *, zip_crc: bool | None = None) -> FileScan:
    """Read `path` once: size and CRC64NVME always; per-entry CRC32 for .pt files (or when zip_crc)."""

    path = Path(path)
    check_zip = path.suffix == ".pt" if zip_crc is None else zip_crc
    problem = None
    entries: list = []
    if check_zip:
        try:
            entries = _zip_entries(path)
        except (zipfile.BadZipFile, OSError, struct.error) as e:
            problem = f"not a complete torch (zip) file: {e}; it may be truncated"
    # Walk the file once; each block feeds the whole-file CRC64 and the CRC32 of the entries it overlaps.
    entries.sort(key=lambda e: e[1])
    crc64 = 0
    entry_crc = [0] * len(entries)
    size = 0
    first = 0  # the first entry that may still overlap a block
    buf = bytearray(BLOCK)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            mv = memoryview(buf)[:n]
            crc64 = checksums.crc64nvme(mv, crc64)
            start, end = size, size + n
            while first < len(entries) and entries[first][1] + entries[first][2] <= start:
                first += 1
            i = first
            while i < len(entries) and entries[i][1] < end:
                _, off, length, _ = entries[i]
                lo, hi = max(off, start), min(off + length, end)
                if lo < hi:
                    entry_crc[i] = zlib.crc32(mv[lo - start:hi - start], entry_crc[i])
                i += 1
            size = end
    if problem is None:
        for (name, off, length, want), got in zip(entries, entry_crc):
            if off + length > size:
                problem = f"entry {name} runs past the end of the file; the file is truncated"
                break
            if got != want:
                problem = f"entry {name} fails its CRC32 check (the bytes were altered)"
                break
    return FileScan(size, crc64nvme_b64(crc64), problem)
