"""What the commands share: the parser that says a usage error as Relay says its errors, the argument
types, the exit codes' text, and the spec, S3 store and Ray cluster a command works on."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from relay.common.errors import RelayError
from relay.devstack import stack
from relay.ops import checkpoint_folder, connections, runs
from relay.ops.connections import RayJobs

FIX = "\n  What to do: "  # how a RelayError prints what to do, in a usage error too


class _Parser(argparse.ArgumentParser):
    """argparse, its usage errors said as Relay's errors are (what is wrong, then what to do), exit 2."""

    def error(self, message: str):
        what, _, fix = message.partition(FIX)
        self.exit(2, f"relay: {what}{FIX}{f'{fix} (`{self.prog} --help`)' if fix else f'see `{self.prog} --help`'}\n")


def _path(kind: str, what: str):
    """An argparse type: a path that exists and is a `kind` ("folder" or "file"), else a usage error naming it."""

    def check(value: str) -> str:
        p = Path(value)
        if not p.exists():
            raise argparse.ArgumentTypeError(f"{value} does not exist{FIX}give {what}")
        if (kind == "folder") != p.is_dir():
            raise argparse.ArgumentTypeError(f"{value} is not a {kind}{FIX}give {what}")
        return value

    return check


def _checkpoints(what: str):
    """An argparse type: a folder that holds a checkpoint (a tracker or a global_step_N folder), or is one; an empty
    folder, or a run folder with no checkpoint yet, is a usage error (nothing there for the command to examine)."""

    def check(value: str) -> str:
        _path("folder", what)(value)
        if not checkpoint_folder.holds_checkpoint(Path(value)):
            raise argparse.ArgumentTypeError(
                f"{value} holds no checkpoint ({checkpoint_folder.NO_CHECKPOINT}){FIX}give {what}"
            )
        return value

    return check


def _s3_uri(value: str) -> str:
    """An argparse type: s3://BUCKET/PREFIX."""
    try:
        connections.check_s3_uri(value)
    except RelayError as e:
        raise argparse.ArgumentTypeError(f"{e.what}{FIX}{e.fix}" if e.fix else e.what) from None
    return value


def _s3_uri_or(local):
    """An argparse type: an s3:// URI, or what `local` accepts."""
    return lambda value: _s3_uri(value) if value.startswith("s3://") else local(value)


def _new_folder(value: str) -> str:
    """An argparse type: a folder to write into, which may not exist yet but is not a file."""
    if Path(value).exists() and not Path(value).is_dir():
        raise argparse.ArgumentTypeError(f"{value} is not a folder{FIX}give a folder to write into")
    return value


def _world_size(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{value}: a world size is a number of processes, at least 1{FIX}give "
            "the number of GPUs (processes) the next chunk trains on"
        )
    return n


RUN_FOLDER = "the run's checkpoint folder (<checkpoint_dir>/<run>, verl's default_local_dir)"
PARQUET = "a parquet file"


def _spec(path: str, check_environment: bool = True):
    return runs.spec_at(path, check_environment=check_environment)


def _ray_address(args) -> str | None:
    """The Ray cluster a run's jobs live on: --ray-address, else RAY_ADDRESS, else the local stack's head when it
    answers."""
    return args.ray_address or os.environ.get("RAY_ADDRESS") or (stack.ray_address() if stack.ray_running() else None)


def _ray_jobs_if_running(args) -> RayJobs | None:
    address = _ray_address(args)
    return connections.ray_jobs(address) if address else None


def _say(line: str) -> None:
    print(line, flush=True)


def _store(uri: str, args=None):
    """A store on uri; an upload command's --sse, --kms-key-id and --acl go with every object it writes."""

    return connections.store_at(
        uri, sse=getattr(args, "sse", None), kms_key_id=getattr(args, "kms_key_id", None), acl=getattr(args, "acl", None)
    )


def _upload_options(c) -> None:
    c.add_argument("--sse", choices=["AES256", "aws:kms"], help="ask S3 for server-side encryption of every object")
    c.add_argument("--kms-key-id", help="the KMS key of --sse aws:kms")
    c.add_argument("--acl", choices=["bucket-owner-full-control", "private"], help="canned ACL of every object")
