"""S3 uploads ask for server-side encryption and a bucket-owner ACL when the spec says so, on every upload
path (single PUT, multipart create, manifest, latest.json, frozen data and reports). The request
parameters are read from botocore's own event hooks on real calls; a SeaweedFS with an SSE key
(security.toml) stores every object encrypted; the session's SeaweedFS, which has none, refuses, and
Relay's error says what was asked and what to do."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from relay.checkpoints import integrity, manifest
from relay.common.errors import StoreError
from relay.runs.folder import RunFolder
from relay.s3.store import CheckpointStore, client_config
from support.ports import free_ports

UPLOADS = {"PutObject", "CreateMultipartUpload"}
PART = 5 << 20


def _client(endpoint: str, capture: list):
    import boto3
    from botocore.config import Config

    c = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id="relay-local",
        aws_secret_access_key="relay-local",
        region_name="us-east-1",
        config=client_config().merge(Config(retries={"mode": "standard", "max_attempts": 1})),
    )
    c.meta.events.register(
        "provide-client-params.s3.*", lambda params, model, **kw: capture.append((model.name, dict(params)))
    )
    return c


def _checkpoint(root: Path, step: int = 4) -> Path:
    """A validated-looking checkpoint folder: one small file, one multipart-sized file, a manifest."""
    run_dir = root / "r"
    d = run_dir / f"global_step_{step}"
    (d / "actor").mkdir(parents=True)
    (d / "data.pt").write_bytes(b"small")
    (d / "actor" / "big.bin").write_bytes(os.urandom(PART + 1024))
    files = {}
    for rel in ("data.pt", "actor/big.bin"):
        s = integrity.scan(d / rel, zip_crc=False)
        files[rel] = {"size": s.size, "crc64nvme": s.crc64nvme}
    manifest.Manifest(run="r", step=step, world_size=1, fsdp_version=2, files=files, params={}).write(d)
    return run_dir


def _exercise(store: CheckpointStore, run_dir: Path, tmp: Path) -> None:
    store.publish(RunFolder("r", run_dir), 4)
    (tmp / "frozen.parquet").write_bytes(b"rows")
    store.put_file(store.run_key("r", "data", "frozen.parquet"), tmp / "frozen.parquet")
    store.put_bytes(store.run_key("r", "report", "report.html"), b"<html></html>", "text/html")
    store.put_json(store.run_key("r", "run.json"), {"run": "r"})


@pytest.fixture(scope="module")
def sse_s3(tmp_path_factory):
    """A private SeaweedFS whose security.toml holds an SSE-S3 key (the session's has none)."""
    d = tmp_path_factory.mktemp("sse-weed")
    key = base64.b64encode(os.urandom(32)).decode()
    (d / "security.toml").write_text(f'[s3.sse]\nkey = "{key}"\n')
    ports = free_ports(8)
    weed = Path(sys.executable).parent / "weed"
    log = open(d / "weed.log", "wb")
    proc = subprocess.Popen(
        [
            str(weed),
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-dir={d}",
            "-s3",
            f"-s3.port={ports[0]}",
            f"-s3.port.grpc={ports[1]}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-metricsPort=0",
            f"-master.port={ports[2]}",
            f"-master.port.grpc={ports[3]}",
            f"-volume.port={ports[4]}",
            f"-volume.port.grpc={ports[5]}",
            f"-filer.port={ports[6]}",
            f"-filer.port.grpc={ports[7]}",
            "-master.volumeSizeLimitMB=64",
            "-volume.max=4",
        ],
        cwd=d,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    endpoint = f"http://127.0.0.1:{ports[0]}"
    c = _client(endpoint, [])
    deadline = time.time() + 60
    while True:
        try:
            c.create_bucket(Bucket="relay")
            break
        except Exception:  # noqa: BLE001 - the filer may still be joining the master
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"the SSE SeaweedFS did not start: {(d / 'weed.log').read_text()[-2000:]}")
            time.sleep(0.5)
    yield endpoint
    os.killpg(proc.pid, signal.SIGKILL)  # SeaweedFS hangs on SIGTERM
    proc.wait()
    log.close()


@pytest.mark.services  # a SeaweedFS of its own, with server-side encryption
def test_every_upload_asks_for_encryption_and_the_acl_and_objects_are_encrypted(sse_s3, tmp_path):
    calls: list = []
    client = _client(sse_s3, calls)
    extra = {"ServerSideEncryption": "AES256", "ACL": "bucket-owner-full-control"}
    store = CheckpointStore(client, f"s3://relay/t-{uuid.uuid4().hex[:8]}", part_size=PART, extra_args=extra)
    _exercise(store, _checkpoint(tmp_path), tmp_path)

    uploads = [(op, p) for op, p in calls if op in UPLOADS]
    keys = {p["Key"].removeprefix(store.prefix + "/") for _, p in uploads}
    assert {
        "r/global_step_4/data.pt",
        "r/global_step_4/actor/big.bin",
        "r/global_step_4/relay_manifest.json",
        "r/latest.json",
        "r/data/frozen.parquet",
        "r/report/report.html",
        "r/run.json",
    } <= keys, keys
    assert "CreateMultipartUpload" in {op for op, _ in uploads}, "the big file went multipart"
    missing = [(op, p["Key"]) for op, p in uploads if any(p.get(k) != v for k, v in extra.items())]
    assert not missing, f"uploads without SSE or ACL: {missing}"
    for key in keys:
        head = client.head_object(Bucket="relay", Key=f"{store.prefix}/{key}")
        assert head.get("ServerSideEncryption") == "AES256", (key, head.get("ServerSideEncryption"))


@pytest.mark.services
def test_kms_settings_travel_with_every_upload(s3_server, tmp_path):
    """aws:kms with a key id: asked for on every upload (the local server has no KMS: refused, clearly)."""
    calls: list = []
    store = CheckpointStore(
        _client(s3_server, calls),
        f"s3://relay/t-{uuid.uuid4().hex[:8]}",
        part_size=PART,
        extra_args={"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "alias/relay"},
    )
    with pytest.raises(StoreError) as e:
        store.publish(RunFolder("r", _checkpoint(tmp_path)), 4)
    assert "ServerSideEncryption=aws:kms" in e.value.fix and "SSEKMSKeyId=alias/relay" in e.value.fix
    assert all(p.get("SSEKMSKeyId") == "alias/relay" for op, p in calls if op in UPLOADS) and calls


@pytest.mark.services
def test_a_server_without_sse_refuses_and_the_error_says_what_to_do(s3_server, tmp_path):
    calls: list = []
    store = CheckpointStore(
        _client(s3_server, calls),
        f"s3://relay/t-{uuid.uuid4().hex[:8]}",
        part_size=PART,
        extra_args={"ServerSideEncryption": "AES256"},
    )
    with pytest.raises(StoreError) as e:
        store.publish(RunFolder("r", _checkpoint(tmp_path)), 4)
    assert "ServerSideEncryption=AES256" in e.value.fix and "security.toml" in e.value.fix
    assert [p.get("ServerSideEncryption") for op, p in calls if op in UPLOADS][:1] == ["AES256"]
    # latest.json never moved: nothing half-published is called latest.
    assert store.latest("r") is None


def test_the_spec_settings_reach_the_store_and_the_cli(tmp_path):
    from relay.cli import _store, build_parser
    from relay.s3.store import store_for_spec
    from relay.spec.run_spec import spec_from_dict
    from support.helpers import spec_dict

    spec = spec_from_dict(
        spec_dict(
            **{"s3.server_side_encryption": "aws:kms", "s3.kms_key_id": "alias/k", "s3.acl": "bucket-owner-full-control"}
        ),
        check_environment=False,
    )
    assert store_for_spec(spec, client=object()).extra_args == {
        "ServerSideEncryption": "aws:kms",
        "SSEKMSKeyId": "alias/k",
        "ACL": "bucket-owner-full-control",
    }
    (tmp_path / "global_step_4").mkdir()  # a folder that holds a checkpoint: what `checkpoint publish` takes
    args = build_parser().parse_args(
        ["checkpoint", "publish", str(tmp_path), "s3://relay/x", "--sse", "AES256", "--acl", "bucket-owner-full-control"]
    )
    assert _store(args.uri, args).extra_args == {"ServerSideEncryption": "AES256", "ACL": "bucket-owner-full-control"}
    from relay.common.errors import SpecError

    with pytest.raises(SpecError, match="kms_key_id is only used with server_side_encryption: aws:kms"):
        spec_from_dict(
            spec_dict(**{"s3.server_side_encryption": "AES256", "s3.kms_key_id": "alias/k"}), check_environment=False
        )
