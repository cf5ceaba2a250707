"""A fault-injecting HTTP proxy in front of the session's S3 server (SeaweedFS), on 127.0.0.1: it passes
requests through, or answers 500 InternalError / 503 SlowDown instead, as a struggling S3 does.

mode "pass": every request goes through; "flaky": every `every`-th request fails (503 and 500 in turn),
so no request fails twice in a row and a client that retries always gets through; "down": every
request fails with 503, until the mode changes. `injected` counts the errors sent."""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "content-length"}
ERRORS = {
    503: ("SlowDown", "Please reduce your request rate."),
    500: ("InternalError", "We encountered an internal error. Please try again."),
}


class FaultyS3Proxy:
    def __init__(self, upstream: str, every: int = 3):
        u = urlparse(upstream)
        self.upstream = (u.hostname, u.port)
        self.mode, self.every = "pass", every
        self.requests = 0
        self.injected: Counter = Counter()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _handle(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                code = proxy._decide()
                if code:
                    err, msg = ERRORS[code]
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{err}</Code><Message>{msg}</Message></Error>'
                    ).encode()
                    self.send_response(code)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP and k.lower() != "expect"}
                conn.request(
                    self.command, self.path, body=body if body or self.command in ("PUT", "POST") else None, headers=headers
                )
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                # A HEAD's Content-Length is the object's size (its body is empty): pass it through.
                length = r.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def _decide(self) -> int | None:
        with self._lock:
            self.requests += 1
            if self.mode == "down":
                code = 503
            elif self.mode == "flaky" and self.requests % self.every == 0:
                code = 503 if (self.requests // self.every) % 2 else 500
            else:
                return None
            self.injected[code] += 1
            return code

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
