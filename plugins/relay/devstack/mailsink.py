"""The local stack's mail sink: an SMTP server on 127.0.0.1 that keeps every message it receives as a file in a
folder (<stack state>/mail/<time>-<n>.eml, readable with any mail client or a text editor), so that the demo's
alert e-mails go somewhere a person can read them. `relay stack up` starts it and points the stack's Airflow
connection smtp_default at it. `python -m relay.devstack.mailsink --port P --dir DIR`."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from pathlib import Path


class FolderHandler:
    """aiosmtpd's handler: each message to a file of its own, written whole (a reader never sees half of one)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.count = 0

    async def handle_DATA(self, server, session, envelope):
        self.count += 1
        name = f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{self.count:04d}.eml"
        tmp = self.folder / f".{name}"
        tmp.write_bytes(b"X-Envelope-To: " + ", ".join(envelope.rcpt_tos).encode() + b"\r\n" + envelope.content)
        tmp.replace(self.folder / name)
        return "250 OK"


def serve(port: int, folder: Path, stop: threading.Event) -> None:
    from aiosmtpd.controller import Controller

    folder.mkdir(parents=True, exist_ok=True)
    controller = Controller(FolderHandler(folder), hostname="127.0.0.1", port=port)
    controller.start()
    try:
        stop.wait()
    finally:
        controller.stop()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m relay.devstack.mailsink")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dir", required=True, type=Path)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    serve(args.port, args.dir, stop)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
