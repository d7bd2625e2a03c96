"""A real S3-compatible server on loopback for tests: moto in server mode, in a child process,
and a small HTTP proxy in front of it that can answer chosen requests with 503 / 429 the way a
throttling object store does."""

from __future__ import annotations

import http.client
import http.server
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoopbackServer:
    """A server process on a free loopback port (``self.port``, ``self.endpoint``), up until
    :meth:`stop`: ``command(port)`` is its command line, ``probe`` a path that answers once it
    serves. RuntimeError with the end of its log if it does not within a minute."""

    def __init__(self, command, probe: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # Its request log goes to a file: a pipe nobody reads fills up and stalls the server.
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(command(self.port), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint + probe, timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    self.log.seek(0)
                    raise RuntimeError(f"{command(self.port)[0]} did not start: {self.log.read().decode()[-2000:]}")
                time.sleep(0.1)

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


class MotoServer(LoopbackServer):
    """``python -m moto.server`` on a free loopback port, up until :meth:`stop`."""

    def __init__(self):
        super().__init__(lambda port: [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                         "/moto-api/")

    def create_bucket(self, name: str):
        request = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        urllib.request.urlopen(request, timeout=10).close()


class LoopbackHTTPServer(http.server.ThreadingHTTPServer):
    """A threaded HTTP server on a free loopback port (the tests' proxies and precondition layer),
    up until :meth:`stop`."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 drops concurrent connects: each waits a 1 s SYN retry

    def stop(self):
        self.shutdown()
        self.server_close()


class QuietHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1, nothing logged; every method goes to :meth:`answer` with the request's body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, body: bytes):
        raise NotImplementedError

    def _any(self):
        self.answer(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_PATCH = _any


class FaultyProxy(LoopbackHTTPServer):
    """Forwards every request to ``upstream``; :meth:`fail` makes the next requests (optionally
    only those of one HTTP method) answer ``status`` without reaching the server, each fault
    on a different object (so a retry after backoff gets through)."""

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream_port = upstream_port
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.to_fail: list[tuple[str | None, int]] = []
        self.failed: list[tuple[str, str, int]] = []   # (method, path, status) answered with a fault
        self.requests: list[tuple[str, str]] = []      # (method, path with query) of every request
        self.bytes_sent: dict[str, int] = {}           # method -> body bytes answered to the client
        self.bytes_by_path: dict[str, int] = {}        # path (with query) -> body bytes answered
        self.forwarded = 0
        self.delays: list[tuple[str, float]] = []     # (part of a path, seconds) to hold such requests
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def fail(self, count: int, status: int = 503, method: str | None = None):
        with self.lock:
            self.to_fail += [(method, status)] * count

    def slow(self, path_part: str, seconds: float):
        """Hold every request whose path contains ``path_part`` for ``seconds`` before it is
        answered: widens the window in which concurrent writers of one object would race."""
        with self.lock:
            self.delays.append((path_part, seconds))

    def delay_for(self, path: str) -> float:
        with self.lock:
            return sum(seconds for part, seconds in self.delays if part in path)

    def fault_for(self, method: str, path: str) -> int | None:
        with self.lock:
            self.requests.append((method, path))
            for i, (only, status) in enumerate(self.to_fail):
                if only in (None, method) and not any(p == path for _, p, _ in self.failed):
                    del self.to_fail[i]
                    self.failed.append((method, path, status))
                    return status
            self.forwarded += 1
            return None

    def objects_written(self) -> list[str]:
        """The object each write request named, in order: an S3 ``PUT``'s path, a GCS upload's
        ``name`` (``POST /upload/storage/v1/b/<bucket>/o?name=...``)."""
        with self.lock:
            requests = list(self.requests)
        out = []
        for method, path in requests:
            url = urllib.parse.urlsplit(path)
            if method == "PUT":
                out.append(url.path)
            elif method == "POST" and url.path.startswith("/upload/"):
                out.append(dict(urllib.parse.parse_qsl(url.query))["name"])
        return out

class _ProxyHandler(QuietHandler):
    server: FaultyProxy

    def answer(self, body: bytes):
        status = self.server.fault_for(self.command, self.path)
        time.sleep(self.server.delay_for(self.path))
        if status is not None:
            reply = b"<Error><Code>SlowDown</Code><Message>injected by the test proxy</Message></Error>"
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)
            return
        sent = relay(self, self.server.upstream_port, body)
        if sent is not None:
            with self.server.lock:
                self.server.bytes_sent[self.command] = self.server.bytes_sent.get(self.command, 0) + sent
                self.server.bytes_by_path[self.path] = self.server.bytes_by_path.get(self.path, 0) + sent


def relay(handler: http.server.BaseHTTPRequestHandler, upstream_port: int, body: bytes) -> int | None:
    """Send ``handler``'s request (its ``body`` already read) to the server on ``upstream_port``
    and its answer back to the client; the body bytes answered (None for HEAD)."""
    upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=60)
    try:
        upstream.request(handler.command, handler.path, body=body or None, headers=dict(handler.headers.items()))
        response = upstream.getresponse()
        data = response.read()
    finally:
        upstream.close()
    handler.send_response(response.status)
    for name, value in response.getheaders():
        if name.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
            handler.send_header(name, value)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    if handler.command == "HEAD":
        return None
    handler.wfile.write(data)
    return len(data)


def s3_environment(endpoint: str) -> dict[str, str]:
    """What TensorStore (through dispatch_io) needs to talk to the test server."""
    return {"AWS_ENDPOINT_URL_S3": endpoint, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}
