"""The dashboard on the web: a page (static/index.html, shipped as package data, polling
/api/state), the snapshot as JSON at /api/state, and Prometheus metrics at /metrics, served on
127.0.0.1. Must not read the DHT (the Watcher does)."""

from __future__ import annotations

import logging
import sys
from importlib.resources import files
from typing import TYPE_CHECKING

from peer.dashboard.metrics import CONTENT_TYPE, prometheus_text
from peer.dashboard.snapshot import to_json

if TYPE_CHECKING:
    from peer.dashboard.reader import Watcher

logger = logging.getLogger("hivepipe.dashboard")


def render_html(refresh: float) -> str:
    page = files("peer.dashboard").joinpath("static/index.html").read_text(encoding="utf-8")
    return page.replace("__REFRESH_MS__", str(max(200, int(refresh * 1000))))


def serve(watcher: "Watcher", port: int, refresh: float) -> int:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    page = render_html(refresh).encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/api/state":
                self._send(200, "application/json", to_json(watcher.current()).encode())
            elif path == "/metrics":
                self._send(200, CONTENT_TYPE, prometheus_text(watcher.current()).encode())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: try /, /api/state or /metrics\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):
            logger.debug("%s %s", self.address_string(), format % args)

    try:
        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    except OSError as e:
        print(f"dashboard: error: cannot listen on 127.0.0.1:{port}: {e.strerror or e}", file=sys.stderr)
        return 2
    httpd.daemon_threads = True
    watcher.thread.start()
    print(f"serving on http://127.0.0.1:{httpd.server_address[1]}", flush=True)
    try:
        httpd.serve_forever(poll_interval=0.25)
    except KeyboardInterrupt:
        pass
    finally:
        watcher.stop.set()
        httpd.server_close()
    return 0
