"""Real alert receivers on 127.0.0.1 for the tests: an SMTP server (aiosmtpd) and an HTTP server that
records JSON posts (a webhook, or a Slack incoming webhook: SlackWebhookHook posts to the URL its
connection names). `connections()` gives the AIRFLOW_CONN_* variables that point Relay at them."""

from __future__ import annotations

import email
import email.policy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from support.ports import free_port


class MailSink:
    """An SMTP server; `messages` holds every message it accepted, parsed."""

    def __init__(self):
        from aiosmtpd.controller import Controller

        self.messages: list[email.message.EmailMessage] = []
        self.port = free_port()
        sink = self

        class Handler:
            async def handle_DATA(self, server, session, envelope):
                msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
                msg["X-Envelope-To"] = ", ".join(envelope.rcpt_tos)
                sink.messages.append(msg)
                return "250 OK"

        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self._controller.start()

    def stop(self) -> None:
        self._controller.stop()

    @staticmethod
    def html(msg) -> str:
        return msg.get_body(("html", "plain")).get_content()


class HttpSink:
    """An HTTP server that answers 200 to every POST and records (path, JSON body)."""

    def __init__(self):
        self.posts: list[tuple[str, dict]] = []
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                sink.posts.append((self.path, json.loads(body or b"{}")))
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(b"ok")  # what Slack answers

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()

    def at(self, path_prefix: str) -> list[dict]:
        return [body for path, body in self.posts if path.startswith(path_prefix)]


def connections(mail: MailSink, http: HttpSink) -> dict[str, str]:
    """Airflow connections (as environment variables) of the receivers, and of a webhook nobody answers."""
    closed = free_port()  # bound once, then released: nothing listens there
    return {
        "AIRFLOW_CONN_RELAY_SMTP": json.dumps(
            {
                "conn_type": "smtp",
                "host": "127.0.0.1",
                "port": mail.port,
                "extra": {
                    "disable_tls": True,
                    "disable_ssl": True,
                    "timeout": 5,
                    "retry_limit": 0,
                    "from_email": "relay@example.com",
                },
            }
        ),
        "AIRFLOW_CONN_RELAY_WEBHOOK": json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{http.port}/alerts"}),
        "AIRFLOW_CONN_RELAY_SLACK": json.dumps(
            {"conn_type": "slackwebhook", "password": f"http://127.0.0.1:{http.port}/slack/T0/B0/s3cr3t"}
        ),
        "AIRFLOW_CONN_RELAY_BROKEN_WEBHOOK": json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{closed}/alerts"}),
    }
