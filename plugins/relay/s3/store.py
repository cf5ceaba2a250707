"""Published checkpoints in S3: publish, list, restore, and the run's `latest` pointer.

    s3://bucket/prefix/<run>/global_step_N/<files>                 verl's layout, file for file
    s3://bucket/prefix/<run>/global_step_N/relay_manifest.json     uploaded after every file
    s3://bucket/prefix/<run>/latest.json                           moved only after the manifest
    s3://bucket/prefix/<run>/run.json                              the run record: its incarnation
    s3://bucket/prefix/.archive/<run>-<time>-<random>/...                   an earlier incarnation, moved aside

Every object carries a full-object CRC64NVME checksum (S3 verifies it on upload, multipart too),
which is the one the manifest records; so a re-publish skips objects that already match, and a
publication is verified by comparing each object's size and checksum with the manifest. The store
is handed a boto3 client: from the Amazon provider's connection in Airflow, from the standard AWS
environment variables (AWS_ENDPOINT_URL included) in the CLI and in Ray jobs.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

import boto3
import urllib3
from awscrt import checksums
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from relay.checkpoints import integrity, manifest
from relay.checkpoints.manifest import Manifest  # for annotations: in CheckpointStore, `manifest` is a method
from relay.common import files
from relay.common.errors import CheckpointError, LeaseLost, RelayError, StoreError
from relay.common.faultpoint import fault_point
from relay.common.timestamps import utc_now
from relay.runs import layout
from relay.runs.folder import RunFolder
from relay.runs.record import RECORD, incarnation_of
from relay.spec.run_spec import RUN_NAME_PATTERN, check_run_name

STEP_PREFIX = re.compile(r"global_step_([0-9]{1,18})/")
LATEST = "latest.json"
ARCHIVE = ".archive"  # <prefix>/.archive/<run>-<time>-<random>/: a run's earlier incarnation (never a run name: '.')
T = TypeVar("T")
COPY_LIMIT = 5 * 2**30  # S3's largest single CopyObject; larger objects are copied part by part


def parse_uri(uri: str) -> tuple[str, str]:
    """(bucket, key) of s3://bucket/key. A key with an empty, '.' or '..' part or a control character is
    refused: S3 servers that map keys to paths (SeaweedFS, MinIO on a filesystem) may resolve it elsewhere."""
    m = re.fullmatch(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?", uri, re.S) if isinstance(uri, str) else None
    if not m:
        raise StoreError(
            f"not an S3 URI: {uri!r}", "use s3://bucket/prefix (a bucket name is 3-63 characters of a-z, 0-9, '.' and '-')"
        )
    key = (m.group(2) or "").strip("/")
    if key and (problem := files.relpath_problem(key)):
        raise StoreError(f"S3 URI {uri!r} refused: its key {key!r}: {problem}", "write the URI without such parts")
    return m.group(1), key


def s3_client(max_pool_connections: int = 16):
    """A boto3 S3 client from the standard AWS environment (AWS_ENDPOINT_URL, keys, region)."""

    return boto3.client("s3", config=client_config(max_pool_connections))


def client_config(max_pool_connections: int = 16):
    # Relay sends its own CRC64NVME checksum with every object and part, and S3 verifies it: botocore
    # need not add another checksum, nor SHA256 the whole body for SigV4 (it does so by default over
    # plain http, which costs a hash pass over every byte published). Headers stay signed.
    return Config(
        retries={"mode": "standard", "max_attempts": 5},
        max_pool_connections=max_pool_connections,
        connect_timeout=10,
        read_timeout=120,
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"payload_signing_enabled": False},
    )


@dataclass
class PublishResult:
    uri: str
    step: int
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    bytes_uploaded: int = 0
    seconds: float = 0.0
    aborted_uploads: int = 0
    latest_moved: bool = False


class CheckpointStore:
    def __init__(
        self, client, uri: str, *, part_size: int = 32 << 20, concurrency: int = 4, extra_args: dict[str, str] | None = None
    ):
        self.client = client
        self.uri = uri.rstrip("/")
        self.bucket, self.prefix = parse_uri(uri)
        self.part_size = part_size
        self.concurrency = concurrency
        self.extra_args = extra_args or {}  # ServerSideEncryption, SSEKMSKeyId, ACL

    # ------------------------------------------------------------------------------ naming
    def run_key(self, run: str, *parts: str) -> str:
        """prefix/run/parts...: the run name is checked as a run name and every part as a relative path, so
        a name read back from a manifest, a record or a command line cannot reach another run's keys."""

        check_run_name(run)
        for p in parts:
            if p and (problem := files.relpath_problem(p)):
                raise StoreError(
                    f"S3 key part {p!r} under run {run} refused: {problem}",
                    "it was read from an altered manifest or record; do not use it",
                )
        return "/".join(p for p in (self.prefix, run, *parts) if p)

    def step_key(self, run: str, step: int, rel: str = "") -> str:
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise StoreError(f"not a step number: {step!r}", "give a step as a whole number >= 0")
        return self.run_key(run, layout.step_name(step), rel)

    def step_uri(self, run: str, step: int) -> str:
        return f"s3://{self.bucket}/{self.step_key(run, step)}/"

    def _call(self, what: str, fn: Callable, **kwargs) -> Any:
        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "?")
            if code in ("404", "NoSuchKey", "NotFound"):
                return None
            fix = "check the bucket, the credentials and the S3 connection"
            if self.extra_args and what in ("PUT", "CREATE-MULTIPART", "UPLOAD-PART", "COMPLETE-MULTIPART"):
                fix = (
                    f"this request asked for {', '.join(f'{k}={v}' for k, v in sorted(self.extra_args.items()))} "
                    f"(spec s3.server_side_encryption / kms_key_id / acl): check that the S3 server supports "
                    f"and is configured for it (SeaweedFS needs s3.sse.kek or s3.sse.key in security.toml for "
                    f"AES256, a KMS for aws:kms), or remove it from the spec; " + fix
                )
            raise StoreError(
                f"S3 {what} on s3://{self.bucket}/{kwargs.get('Key', kwargs.get('Prefix', ''))} failed: {code}: {e}", fix
            ) from None
        except BotoCoreError as e:
            raise StoreError(
                f"S3 at {self.client.meta.endpoint_url} unreachable during {what}: {e}",
                "start the S3 server or fix the connection's endpoint_url; nothing was lost, "
                "publishing again resumes where this stopped",
            ) from None

    # ------------------------------------------------------------------------------ reading
    def head(self, key: str) -> dict | None:
        return self._call("HEAD", self.client.head_object, Key=key, ChecksumMode="ENABLED")

    def get_json(self, key: str) -> dict | None:
        r = self._call("GET", self.client.get_object, Key=key)
        if r is None:
            return None
        try:
            return json.loads(r["Body"].read().decode("utf-8", "replace"))
        except (ValueError, RecursionError) as e:
            raise StoreError(
                f"s3://{self.bucket}/{key} is not valid JSON ({str(e)[:120]})",
                "it was damaged or written by something else than Relay; delete it, or publish again to rewrite it",
            ) from None

    def latest(self, run: str) -> dict | None:
        """The run's latest.json, checked: its step is a step number (it is used to build keys)."""
        d = self.get_json(self.run_key(run, LATEST))
        if d is None:
            return None
        step = d.get("step") if isinstance(d, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise StoreError(
                f"s3://{self.bucket}/{self.run_key(run, LATEST)} is malformed: its step is "
                f"{str(step)[:40]!r}, not a step number",
                "publish the run's newest checkpoint again (`python -m relay checkpoint publish`): "
                "that rewrites latest.json",
            )
        return d

    def manifest(self, run: str, step: int) -> Manifest | None:
        where = f"{self.step_uri(run, step)}{manifest.NAME}"
        r = self._call("GET", self.client.get_object, Key=self.step_key(run, step, manifest.NAME))
        if r is None:
            return None
        m = manifest.Manifest.from_json(r["Body"].read(), where)
        if m.step != step:
            raise CheckpointError(
                f"{where} names step {m.step}, not {step}: it was copied or altered",
                "publish the checkpoint of that step again",
            )
        return m

    def manifest_at(self, uri: str) -> Manifest:
        """A manifest by its S3 URI (what asset events carry)."""
        bucket, key = parse_uri(uri)
        r = self._call("GET", self.client.get_object, Key=key) if bucket == self.bucket else None
        if r is None:
            raise StoreError(f"no manifest at {uri}", "check the URI; `python -m relay checkpoint ls` lists them")
        return manifest.Manifest.from_json(r["Body"].read().decode(), uri)

    def download_object(self, key_or_uri: str, dest: Path, expect: dict | None = None) -> None:
        """Download one object; with expect ({size, crc64nvme}), verify it."""

        if key_or_uri.startswith("s3://"):
            bucket, key = parse_uri(key_or_uri)
            if bucket != self.bucket:
                raise StoreError(
                    f"{key_or_uri} is not in this store's bucket {self.bucket}", f"use an s3://{self.bucket}/... URI"
                )
        else:
            key = key_or_uri
        r = self._call("GET", self.client.get_object, Key=key)
        if r is None:
            raise StoreError(f"s3://{self.bucket}/{key} does not exist", "check the URI")
        crc, size = 0, 0
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest, "wb") as out:
            for chunk in r["Body"].iter_chunks(8 << 20):
                crc = checksums.crc64nvme(chunk, crc)
                size += len(chunk)
                out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        if expect and (size != expect["size"] or integrity.crc64nvme_b64(crc) != expect["crc64nvme"]):
            raise CheckpointError(
                f"s3://{self.bucket}/{key} does not match its manifest",
                "publish the checkpoint again, or restore an older one",
            )

    def _pages(self, what: str, **kwargs):
        """The pages of a ListObjectsV2 (boto3's paginator), errors said as StoreErrors."""

        try:
            yield from self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, **kwargs)
        except (ClientError, BotoCoreError):
            # the paginator's first failing page: _call says what failed and what to do
            self._call(what, self.client.list_objects_v2, **kwargs)
            raise

    def _objects(self, prefix: str) -> list[dict]:
        """Every object under prefix ({Key, Size}), however many pages."""
        return [o for page in self._pages("LIST", Prefix=prefix) for o in page.get("Contents", [])]

    def steps(self, run: str) -> list[int]:
        """Steps with objects under the run's prefix (published or not), ascending. From the objects, not the
        "folders": SeaweedFS keeps listing a folder whose objects were all deleted."""
        prefix = self.run_key(run) + "/"
        return sorted({int(m.group(1)) for o in self._objects(prefix) if (m := STEP_PREFIX.match(o["Key"][len(prefix) :]))})

    def runs(self) -> list[str]:
        """Run names under the prefix (a folder there whose name is no run name, .archive say, is left out)."""

        names = (
            cp["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            for page in self._pages("LIST", Prefix=(self.prefix + "/") if self.prefix else "", Delimiter="/")
            for cp in page.get("CommonPrefixes", [])
        )
        return sorted(n for n in names if re.fullmatch(RUN_NAME_PATTERN, n) and ".." not in n)

    def published(self, run: str) -> list[Manifest]:
        """Checkpoints whose manifest is in place (complete publications), ascending by step."""
        return [m for s in self.steps(run) if (m := self.manifest(run, s)) is not None]

    # ------------------------------------------------------------------------------ incarnations
    def run_record(self, run: str) -> dict | None:
        """The run record published beside the run's checkpoints (relay.runs.record), or None."""
        return self.get_json(self.run_key(run, RECORD))

    def incarnation(self, run: str) -> str | None:
        """The incarnation of the run S3 holds under <prefix>/<run>/: its published record's, else its
        newest manifest's; None when S3 holds neither (nothing of the run was published)."""
        record = self.run_record(run)
        if record:
            return incarnation_of(record)
        for step in reversed(self.steps(run)):
            try:
                m = self.manifest(run, step)
            except CheckpointError:
                continue
            if m is not None:
                return m.incarnation
        return None

    def archive_run(self, run: str, name: str) -> str:
        """Move everything under <prefix>/<run>/ to <prefix>/.archive/<name>/ (a fresh start's move of the old
        incarnation, never a deletion): each object is copied on the server, verified (size, CRC64NVME),
        and only then are the originals removed, latest.json and the manifests first, so that no reader
        finds a manifest over missing files. Repeating it after a failure finishes the move. Returns the
        archive's URI."""
        self.abort_incomplete_uploads(run)
        src = self.run_key(run) + "/"
        dest = "/".join(p for p in (self.prefix, ARCHIVE, name) if p) + "/"
        objects = self._objects(src)
        for o in objects:
            self._copy(o["Key"], dest + o["Key"][len(src) :], o["Size"])
        first = [o["Key"] for o in objects if o["Key"].endswith((LATEST, manifest.NAME))]
        self._delete_keys(first)
        self._delete_keys([o["Key"] for o in objects if not o["Key"].endswith((LATEST, manifest.NAME))])
        return f"s3://{self.bucket}/{dest}"

    def _delete_keys(self, keys: list[str]) -> None:
        """Delete objects, 1000 to a request (S3's limit for DeleteObjects)."""
        for i in range(0, len(keys), 1000):
            self._call(
                "DELETE",
                self.client.delete_objects,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def _copy(self, src: str, dest: str, size: int) -> None:
        """A server-side copy with a full-object CRC64NVME, checked against the source's."""
        source = {"Bucket": self.bucket, "Key": src}
        if size <= COPY_LIMIT:
            self._call(
                "COPY",
                self.client.copy_object,
                Key=dest,
                CopySource=source,
                ChecksumAlgorithm="CRC64NVME",
                **self.extra_args,
            )
        else:
            up = self._call(
                "CREATE-MULTIPART",
                self.client.create_multipart_upload,
                Key=dest,
                ChecksumAlgorithm="CRC64NVME",
                ChecksumType="FULL_OBJECT",
                **self.extra_args,
            )
            parts = []
            for i, start in enumerate(range(0, size, self.part_size)):
                r = self._call(
                    "UPLOAD-PART-COPY",
                    self.client.upload_part_copy,
                    Key=dest,
                    UploadId=up["UploadId"],
                    PartNumber=i + 1,
                    CopySource=source,
                    CopySourceRange=f"bytes={start}-{min(start + self.part_size, size) - 1}",
                )
                parts.append(
                    {
                        "PartNumber": i + 1,
                        "ETag": r["CopyPartResult"]["ETag"],
                        **({"ChecksumCRC64NVME": c} if (c := r["CopyPartResult"].get("ChecksumCRC64NVME")) else {}),
                    }
                )
            self._call(
                "COMPLETE-MULTIPART",
                self.client.complete_multipart_upload,
                Key=dest,
                UploadId=up["UploadId"],
                MultipartUpload={"Parts": parts},
                ChecksumType="FULL_OBJECT",
            )
        a, b = self.head(src), self.head(dest) or {}
        if a is None and b:
            # Gone since it was copied: a writer of the old incarnation that a fresh start overtook took it back
            # (FencedWrites). What was copied is that writer's object, and it belongs in the archive with the rest.
            return
        a = a or {}
        if a.get("ContentLength") != b.get("ContentLength") or a.get("ChecksumCRC64NVME") != b.get("ChecksumCRC64NVME"):
            raise StoreError(
                f"copy of s3://{self.bucket}/{src} to {dest} does not match it "
                f"({b.get('ContentLength')} bytes, {b.get('ChecksumCRC64NVME')}; the source: "
                f"{a.get('ContentLength')} bytes, {a.get('ChecksumCRC64NVME')})",
                "nothing was removed; run the fresh start again: it copies what is missing first",
            )

    def _refuse_other_incarnation(self, run: str, m: Manifest) -> None:
        held = self.incarnation(run)
        if held is not None and held != m.incarnation:
            raise StoreError(
                f"{self.uri}/{run}/ holds incarnation {held} of run {run}; step {m.step} is of incarnation "
                f"{m.incarnation}: publishing it would overwrite another run's objects",
                f"publish under another run name or prefix; or, if the published run is this run's earlier life, "
                f"start this run with a confirmed fresh start (it moves {self.uri}/{run}/ aside, never deleting it)",
            )

    # ------------------------------------------------------------------------------ publish
    def publish(self, folder: RunFolder, step: int) -> PublishResult:
        """Upload a validated checkpoint of the run's folder (its manifest must be in its step folder) under the
        run's name, then its manifest, then latest."""
        run, run_dir = folder.name, folder.path
        t0 = time.time()
        step_dir = layout.step_dir(run_dir, step)
        m = manifest.read(step_dir)
        if m is None:
            raise CheckpointError(
                f"{step_dir} has no {manifest.NAME}: only validated checkpoints are published",
                f"run `python -m relay checkpoint validate {run_dir} --step {step}` first",
            )
        self._refuse_other_incarnation(run, m)
        self._withdraw_if_changed(run, m)
        result = PublishResult(self.step_uri(run, step), step)
        result.aborted_uploads = self.abort_incomplete_uploads(run)
        todo = []
        for rel, f in sorted(m.files.items()):
            if self._matches(self.head(self.step_key(run, step, rel)), f):
                result.skipped.append(rel)
            else:
                todo.append(rel)
        with ThreadPoolExecutor(self.concurrency) as pool:
            parts = [(rel, self._start(run, step, rel, m.files[rel], step_dir / rel)) for rel in todo]
            futures = [(rel, up, pool.submit(self._upload_part, up, i)) for rel, up in parts for i in range(up["n"])]
            for _rel, up, fut in futures:
                up["done"][fut.result()[0]] = fut.result()[1]
        for rel, up in parts:
            self._finish(up)
            result.uploaded.append(rel)
            result.bytes_uploaded += m.files[rel]["size"]
        fault_point("publish_files", step)
        # The manifest and latest.json make the files a publication: written only while the run is still this
        # incarnation's, and taken back if a fresh start moved the prefix aside meanwhile. The files themselves
        # stay: no manifest names them, and a later publication reuses one only where its size and CRC64NVME match.
        with self.fenced(folder, f"publishing step {step}") as w:
            w.check()  # a fresh start that moved the files away is named as such, not as a mismatch
            self.verify(run, m)
            w.put_bytes(self.step_key(run, step, manifest.NAME), m.to_json().encode())
            fault_point("publish_manifest", step)
            try:
                current = self.latest(run)
            except StoreError:  # a damaged latest.json names nothing: this publication replaces it
                current = None
            if current is None or current["step"] <= step:
                w.put_bytes(self.run_key(run, LATEST), self._latest_body(run, step))
                result.latest_moved = True
        result.seconds = time.time() - t0
        return result

    def fenced(self, folder: RunFolder, what: str) -> FencedWrites:
        """Small objects written under the run's prefix for `folder`'s incarnation (FencedWrites)."""
        return FencedWrites(self, folder, what)

    def _withdraw_if_changed(self, run: str, m: Manifest) -> None:
        """A step published before with other bytes (retrained after a quarantine, say) stops counting as
        published before any of its objects is replaced: its manifest goes first, and `latest` falls back
        to the newest other published step, so S3 never shows a manifest over bytes it does not list."""
        before: Manifest | Literal[False] | None
        try:
            before = self.manifest(run, m.step)
        except CheckpointError:
            before = False  # a damaged manifest: withdrawn all the same
        if before is None or (before and before.files == m.files):
            return
        self._call("DELETE", self.client.delete_object, Key=self.step_key(run, m.step, manifest.NAME))
        try:
            current = self.latest(run)
        except StoreError:
            current = None
        if current is not None and current["step"] == m.step:
            older = [x for x in self.published(run) if x.step < m.step]
            if older:
                self._put_latest(run, older[-1].step)
            else:
                self._call("DELETE", self.client.delete_object, Key=self.run_key(run, LATEST))

    def _put_latest(self, run: str, step: int) -> None:
        self._put_bytes(self.run_key(run, LATEST), self._latest_body(run, step))

    def _latest_body(self, run: str, step: int) -> bytes:
        uri = self.step_uri(run, step)
        latest = {"step": step, "uri": uri, "manifest": f"{uri}{manifest.NAME}", "published_at": utc_now()}
        return json.dumps(latest).encode()

    @staticmethod
    def _matches(head: dict | None, f: dict) -> bool:
        if not head:
            return False
        return head.get("ContentLength") == f["size"] and head.get("ChecksumCRC64NVME") == f["crc64nvme"]

    def put_file(self, key: str, path: Path) -> str:
        """Upload a file (frozen data, a report) unless an equal object is there; return its URI."""
        scan = integrity.scan(path, zip_crc=False)
        if not self._matches(self.head(key), {"size": scan.size, "crc64nvme": scan.crc64nvme}):
            up = self._start_key(key, Path(path), scan.size, scan.crc64nvme)
            with ThreadPoolExecutor(self.concurrency) as pool:
                for i, part in pool.map(lambda i: self._upload_part(up, i), range(up["n"])):
                    up["done"][i] = part
            self._finish(up)
        return f"s3://{self.bucket}/{key}"

    def put_json(self, key: str, obj) -> None:
        self._put_bytes(key, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def delete_checkpoint(self, run: str, step: int) -> int:
        """Delete a published checkpoint: its manifest first, so it stops counting as published at once."""
        self._call("DELETE", self.client.delete_object, Key=self.step_key(run, step, manifest.NAME))
        keys = [o["Key"] for o in self._objects(self.step_key(run, step) + "/")]
        self._delete_keys(keys)
        return len(keys)

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> str:
        """Upload small bytes in one PUT; a content type lets a browser show it (a report page). Returns its URI."""
        self._put_bytes(key, data, **({"ContentType": content_type} if content_type else {}))
        return f"s3://{self.bucket}/{key}"

    def _put_bytes(self, key: str, data: bytes, **extra) -> str:
        """One PUT; the object's ETag."""
        crc = integrity.crc64nvme_b64(integrity.crc64nvme_bytes(data))
        r = self._call("PUT", self.client.put_object, Key=key, Body=data, ChecksumCRC64NVME=crc, **extra, **self.extra_args)
        return str((r or {}).get("ETag", ""))

    def _start(self, run: str, step: int, rel: str, f: dict, path: Path) -> dict:
        return self._start_key(self.step_key(run, step, rel), path, f["size"], f["crc64nvme"])

    def _start_key(self, key: str, path: Path, size: int, crc: str) -> dict:
        """Plan one object's upload: a single PUT below the part size, else a multipart upload."""
        n = max(1, -(-size // self.part_size))
        up = {"key": key, "path": path, "size": size, "crc": crc, "n": n, "done": {}, "id": None}
        if n > 1:
            r = self._call(
                "CREATE-MULTIPART",
                self.client.create_multipart_upload,
                Key=key,
                ChecksumAlgorithm="CRC64NVME",
                ChecksumType="FULL_OBJECT",
                **self.extra_args,
            )
            up["id"] = r["UploadId"]
        return up

    def _upload_part(self, up: dict, i: int) -> tuple[int, dict]:
        with open(up["path"], "rb") as fh:
            data = os.pread(fh.fileno(), self.part_size, i * self.part_size)
        crc = integrity.crc64nvme_b64(integrity.crc64nvme_bytes(data))
        if up["id"] is None:
            if crc != up["crc"] or len(data) != up["size"]:
                raise CheckpointError(
                    f"{up['path']} changed since validation (CRC64NVME differs from the manifest)",
                    "validate the checkpoint again; never publish a file that changed",
                )
            self._call("PUT", self.client.put_object, Key=up["key"], Body=data, ChecksumCRC64NVME=crc, **self.extra_args)
            return i, {}
        r = self._call(
            "UPLOAD-PART",
            self.client.upload_part,
            Key=up["key"],
            UploadId=up["id"],
            PartNumber=i + 1,
            Body=data,
            ChecksumCRC64NVME=crc,
        )
        return i, {"PartNumber": i + 1, "ETag": r["ETag"], "ChecksumCRC64NVME": crc}

    def _finish(self, up: dict) -> None:
        if up["id"] is None:
            return
        parts = [up["done"][i] for i in range(up["n"])]
        # S3 checks the whole object's CRC64NVME against the manifest's: a file that changed is refused.
        self._call(
            "COMPLETE-MULTIPART",
            self.client.complete_multipart_upload,
            Key=up["key"],
            UploadId=up["id"],
            MultipartUpload={"Parts": parts},
            ChecksumCRC64NVME=up["crc"],
            ChecksumType="FULL_OBJECT",
        )

    def abort_incomplete_uploads(self, run: str) -> int:
        """Abort multipart uploads a killed publish left under the run's prefix."""
        r = self._call("LIST-MULTIPART", self.client.list_multipart_uploads, Prefix=self.run_key(run) + "/") or {}
        uploads = r.get("Uploads", [])
        for u in uploads:
            self._call("ABORT-MULTIPART", self.client.abort_multipart_upload, Key=u["Key"], UploadId=u["UploadId"])
        return len(uploads)

    def verify(self, run: str, m: Manifest) -> None:
        """Every object exists with the size and CRC64NVME the manifest records."""
        bad = []
        for rel, f in m.files.items():
            head = self.head(self.step_key(run, m.step, rel))
            if not self._matches(head, f):
                got = "missing" if head is None else f"{head.get('ContentLength')} bytes, {head.get('ChecksumCRC64NVME')}"
                bad.append(f"{rel} ({got}; manifest: {f['size']} bytes, {f['crc64nvme']})")
        if bad:
            raise StoreError(
                f"publication of step {m.step} does not match its manifest: {'; '.join(bad[:5])}",
                "publish again: objects that match are skipped, the others are uploaded again",
            )

    # ------------------------------------------------------------------------------ restore
    def download(self, run: str, m: Manifest, dest: Path, on_file: Callable[[str, Path], T] | None = None) -> dict[str, T]:
        """Download a published checkpoint into dest, verifying each file's size and CRC64NVME.

        Every file is cut into ranges of the part size (as it was published) fetched by concurrent ranged GETs,
        the largest files first, each written in place (pwrite into a preallocated file) and checksummed as
        its bytes arrive; a file's CRC64NVME is the combination of its ranges' (awscrt), compared with the
        manifest once its last range is in. on_file(rel, path) runs on each whole, verified file (the gate's
        per-file checks, which so overlap the rest of the download); returns what it returned, by file."""
        plans: list[_FileDownload] = []
        problems: list[str] = []
        for rel in sorted(m.files, key=lambda r: -int(m.files[r]["size"])):
            target = dest / files.check_relpath(rel, f"the manifest of {self.step_uri(run, m.step)}")
            if not target.resolve().is_relative_to(dest.resolve()):
                problems.append(f"{rel}: resolves outside {dest}")
                continue
            plans.append(_FileDownload(rel, self.step_key(run, m.step, rel), target, m.files[rel], self.part_size))
        if problems:
            raise CheckpointError(
                f"download of {self.step_uri(run, m.step)} refused: {'; '.join(problems[:5])}",
                "an older published checkpoint is tried next",
            )
        _refuse_without_space(dest, sum(plan.size for plan in plans), self.step_uri(run, m.step))
        results: dict[str, T] = {}
        try:
            for plan in plans:
                plan.open()
            # Large files' ranges go first, so the last ranges to finish are small ones.
            with ThreadPoolExecutor(download_concurrency()) as pool, ThreadPoolExecutor(2) as checks:
                gets = {pool.submit(self._get_range, plan, i): plan for plan in plans for i in range(plan.n)}
                pending = {}
                for fut in as_completed(gets):
                    plan = gets[fut]
                    if fut.result() and not plan.problem and on_file is not None:
                        pending[plan.rel] = checks.submit(on_file, plan.rel, plan.target)
                results = {rel: fut.result() for rel, fut in pending.items()}
        except OSError as e:  # disk full, permissions: a local failure, never taken for a damaged publication
            raise RelayError(
                f"download of {self.step_uri(run, m.step)} into {dest} failed: {e}",
                "free space (or fix the folder's permissions) and restore again; nothing published or "
                "already in the run folder was touched",
                retry_helps=True,
            ) from None
        finally:
            for plan in plans:
                plan.close()
        problems = [f"{plan.rel}: {plan.problem}" for plan in plans if plan.problem]
        if problems:
            raise CheckpointError(
                f"download of {self.step_uri(run, m.step)} is damaged: {'; '.join(problems[:5])}",
                "an older published checkpoint is tried next",
            )
        files.atomic_write(dest / manifest.NAME, m.to_json().encode())
        return results

    def _get_range(self, plan: _FileDownload, i: int) -> bool:
        """Fetch range i of a file into place; True when it was the file's last (the file is then verified,
        fsynced and closed)."""
        start, length = plan.range(i)
        crc, got = 0, 0
        if length and not plan.problem:
            try:
                r = self._call(
                    "GET",
                    self.client.get_object,
                    Key=plan.key,
                    **({"Range": f"bytes={start}-{start + length - 1}"} if plan.n > 1 else {}),
                )
                if r is None:
                    raise StoreError(f"s3://{self.bucket}/{plan.key} does not exist", "publish it again")
                if r.get("ContentLength", length) != length:
                    raise StoreError(
                        f"is {r['ContentLength']} bytes in S3, its manifest records {plan.size}: it was altered"
                        if plan.n == 1
                        else f"range {start}-{start + length - 1} came back as {r['ContentLength']} bytes"
                    )
                for chunk in r["Body"].iter_chunks(RANGE_READ):
                    if got + len(chunk) > length:
                        raise StoreError(f"range {start}-{start + length - 1} returned more than {length} bytes")
                    os.pwrite(plan.fd, chunk, start + got)
                    crc = checksums.crc64nvme(chunk, crc)
                    got += len(chunk)
                if got != length:
                    raise StoreError(f"range {start}-{start + length - 1} returned {got} bytes, not {length}")
            except (StoreError, CheckpointError) as e:
                plan.fail(e.what)
            except (BotoCoreError, urllib3.exceptions.HTTPError) as e:  # the connection broke mid-body
                plan.fail(f"reading range {start}-{start + length - 1} failed: {e}")
        return plan.part_done(i, crc, length)


RANGE_READ = 1 << 20  # a range is written as it arrives, 1 MiB at a time: memory stays concurrency x 1 MiB


def _refuse_without_space(dest: Path, needed: int, uri: str) -> None:
    """Before anything is preallocated: the checkpoint must fit on dest's volume."""
    folder = Path(dest)
    while not folder.exists():
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise RelayError(
            f"restoring {uri} needs {needed:,} bytes in {dest}, and its volume has {free:,} free",
            f"free {needed - free:,} bytes or more on that volume (or lower checkpoints.keep_local), then "
            "restore again; nothing was written",
            retry_helps=True,
        )


def download_concurrency() -> int:
    """Ranged GETs at once: most of a GET's time is waiting on the server and the network, so several per
    core (the client's connection pool, 16 by default, bounds it too)."""
    return max(4, min(16, 4 * (os.cpu_count() or 1)))


class _FileDownload:
    """One file of a download: its ranges (the publish's part size), the preallocated target they are
    written into, and the CRC64NVME of each, combined in order once all are in."""

    def __init__(self, rel: str, key: str, target: Path, expect: dict, part_size: int):
        self.rel, self.key, self.target, self.expect = rel, key, target, expect
        self.size = int(expect["size"])
        self.part_size = part_size
        self.n = max(1, -(-self.size // part_size))
        self.crcs: dict[int, tuple[int, int]] = {}
        self.problem: str | None = None
        self.fd: int = -1
        self._lock = threading.Lock()

    def open(self) -> None:
        self.target.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if self.size:
            try:  # the space is taken now: a full disk fails before any GET
                os.posix_fallocate(self.fd, 0, self.size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: written as it comes
                    raise

    def range(self, i: int) -> tuple[int, int]:
        start = i * self.part_size
        return start, min(self.part_size, self.size - start)

    def fail(self, problem: str) -> None:
        with self._lock:
            self.problem = self.problem or problem

    def part_done(self, i: int, crc: int, length: int) -> bool:
        with self._lock:
            self.crcs[i] = (crc, length)
            if len(self.crcs) < self.n:
                return False
        if self.problem is None:
            whole = 0
            for j in range(self.n):
                part, n = self.crcs[j]
                whole = checksums.combine_crc64nvme(whole, part, n) if j else part
            if integrity.crc64nvme_b64(whole) != self.expect["crc64nvme"]:
                self.fail("does not match its manifest (CRC64NVME differs)")
        os.fsync(self.fd)
        self.close()
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def upload_args(sse: str | None, kms_key_id: str | None, acl: str | None) -> dict[str, str]:
    """What every upload asks of S3: server-side encryption (and its KMS key), a canned ACL; unset: nothing."""
    return {k: v for k, v in (("ServerSideEncryption", sse), ("SSEKMSKeyId", kms_key_id), ("ACL", acl)) if v}


def store_for_spec(spec, client=None) -> CheckpointStore:
    s3 = spec.s3
    return CheckpointStore(
        client or s3_client(),
        s3.uri,
        part_size=s3.part_size_mb << 20,
        concurrency=s3.concurrency,
        extra_args=upload_args(s3.server_side_encryption, s3.kms_key_id, s3.acl),
    )


class FencedWrites:
    """The small objects that make a run's state in S3 (a manifest, latest.json, the run record, its history)
    written for one incarnation of the run: the folder's fence (relay.runs.lease.Lease.fence) is checked before
    each PUT and once after the last. The lock is not held across S3, so a fresh start can be decided while a PUT
    is in flight; a writer that finds itself fenced out afterwards takes back every object that is still as it
    wrote it (same ETag) and raises LeaseLost. Either its objects were there before the fresh start listed the
    prefix (they went to the archive with the rest) or they are taken back: none stays under the new incarnation's
    prefix. A folder without an incarnation (a manual publish of a folder with no run record) is fenced only by a
    fresh start under way."""

    def __init__(self, store: CheckpointStore, folder: RunFolder, what: str):
        self.store, self.folder, self.what = store, folder, what
        self.written: list[tuple[str, str]] = []  # (key, ETag), in the order written

    def check(self) -> None:
        """LeaseLost once the run is no longer this writer's incarnation, or while a fresh start moves it aside."""
        self.folder.lease().fence(self.what)

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> str:
        self.check()
        extra = {"ContentType": content_type} if content_type else {}
        self.written.append((key, self.store._put_bytes(key, data, **extra)))
        return f"s3://{self.store.bucket}/{key}"

    def put_json(self, key: str, obj) -> str:
        return self.put_bytes(key, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())

    def __enter__(self) -> FencedWrites:
        return self

    def __exit__(self, kind, error, tb) -> None:
        if kind is None:
            try:
                self.check()
            except LeaseLost as lost:
                self._take_back()
                raise lost from None
        elif issubclass(kind, LeaseLost):
            self._take_back()

    def _take_back(self) -> None:
        for key, etag in reversed(self.written):
            head = self.store.head(key)
            if head is not None and etag and head.get("ETag") == etag:
                self.store._call("DELETE", self.store.client.delete_object, Key=key)
        self.written.clear()
