"""The health page's web server: page.html at `/` (no build step: it fetches `/data.json` and
redraws itself every few seconds) and the latest reading of the swarm at `/data.json`.

The server only hands out what it was given (`update`); reading the swarm is its owner's job
(peers.status), so a page open in many browsers costs the swarm nothing more.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from swarm.transport.hivemind.monitor.health import to_json

PAGE = Path(__file__).with_name("page.html")


class HealthServer:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self._page = PAGE.read_bytes()
        self._data = json.dumps(
            {"generated": 0, "refresh_s": 2.0, "error": "reading the swarm...", "runs": []}
        ).encode()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                path = self.path.split("?", 1)[0]
                if path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", server._page)
                elif path == "/data.json":
                    self._send(200, "application/json", server._data)
                else:
                    self._send(
                        404, "text/plain; charset=utf-8", b"not found: the page is at /, its data at /data.json\n"
                    )

            timeout = 10  # an idle connection does not hold its thread for ever

            def _send(self, code: int, kind: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("X-Content-Type-Options", "nosniff")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # noqa: A002 (http.server's name)
                pass  # a page refreshing every few seconds would fill the terminal

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as e:
            raise RuntimeError(f"--serve {port}: {e.strerror or e}") from None
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="health-page", daemon=True)
        self._thread.start()

    def update(self, data: dict) -> None:
        self._data = to_json(data).encode()  # one assignment: a request reads the old or the new

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
