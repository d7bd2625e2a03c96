"""A proxy on loopback that makes chosen object-store requests slow: the tests' stalling and
trickling network.

:class:`SlowProxy` forwards every HTTP request to a GCS or S3 test server (``tests/gcs_server.py``,
``tests/s3_server.py``) and answers as it does, except the requests a :class:`Fault` picks -- the
``nth`` request (counting from 1) whose method is ``method`` and whose object name contains
``contains``, e.g. the first ``GET`` of an object under ``arrays/``:

* ``"stall"``: the request is accepted (its body read) and never answered; the connection stays
  open until the proxy stops -- what a hung server or a black-holed connection looks like.
* ``"lose"``: the request reaches the server (and takes effect there), its answer never comes
  back -- a write whose success the client cannot learn.
* ``"trickle"``: the request reaches the server, and its answer is sent back at ``rate`` bytes
  per second (2 KiB/s by default): alive, so no idle timeout fires.

With ``min_bytes``, only requests whose answer holds at least that many bytes match (a chunk's
data, not an index node or a zarr.json): such a request reaches the server, and its answer is
then stalled or trickled.

It counts the requests and the answer body bytes it sent per method, so a test can tell how many
requests a call made and how many bytes it read (a hedged read costs bytes).
"""

from __future__ import annotations

import dataclasses
import http.client
import http.server
import threading
import time
import urllib.parse

from gcs_server import object_of
from s3_server import LoopbackHTTPServer, QuietHandler

_HOP = ("content-length", "transfer-encoding", "connection", "server", "date", "keep-alive")


@dataclasses.dataclass
class Fault:
    """Which request to slow, and how (see the module's docstring). ``hit``: the requests it
    was applied to, as (method, object name)."""

    mode: str                       # "stall", "lose" or "trickle"
    method: str                     # HTTP method, e.g. "GET", "POST" (GCS upload), "PUT" (S3 upload)
    contains: str = "arrays/"       # a part of the object's name
    nth: int = 1                    # the nth matching request (from 1) ...
    count: int = 1                  # ... and the count - 1 matching ones after it
    rate: int = 2048                # trickle: bytes per second ...
    min_bytes: int = 0              # ... of an answer this large or larger
    seen: int = 0
    hit: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        if self.mode not in ("stall", "lose", "trickle"):
            raise ValueError(f"mode must be 'stall', 'lose' or 'trickle', got {self.mode!r}")


def object_name(method: str, path: str) -> str | None:
    """The object a request is for: GCS (``object_of``) or S3 path-style (``/<bucket>/<key>``);
    None for a request that names none (a listing, a bucket)."""
    gcs = object_of(method, path)
    if gcs is not None:
        return gcs[1]
    url = urllib.parse.urlsplit(path)
    if url.path.startswith(("/storage/", "/upload/")):
        return None
    bucket, _, key = url.path.lstrip("/").partition("/")
    return urllib.parse.unquote(key) if bucket and key else None


class SlowProxy(LoopbackHTTPServer):
    """Forwards every request to the server on ``upstream_port`` (loopback), slowing the ones
    :meth:`add` picks. ``endpoint`` is what to point TensorStore at; :meth:`stop` ends it and
    closes every connection it holds (stalled ones too)."""

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.upstream_port = upstream_port
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self.lock = threading.Lock()
        self.faults: list[Fault] = []
        self.requests: list[tuple[str, str]] = []      # (method, object name or path) of every request
        self.bytes_sent: dict[str, int] = {}           # method -> answer body bytes sent
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def add(self, fault: Fault) -> Fault:
        with self.lock:
            self.faults.append(fault)
        return fault

    def reset_counts(self):
        with self.lock:
            self.requests.clear()
            self.bytes_sent.clear()

    def count(self, method: str, contains: str = "arrays/") -> int:
        """How many ``method`` requests named an object containing ``contains``."""
        with self.lock:
            return sum(1 for m, name in self.requests if m == method and contains in name)

    def fault_for(self, method: str, path: str, answer_bytes: int | None = None) -> Fault | None:
        """The fault that picks this request, if any: as it arrives (``answer_bytes`` None; the
        request is counted then) a stall without ``min_bytes``, once its answer's size is known
        the others."""
        name = object_name(method, path)
        with self.lock:
            if answer_bytes is None:
                self.requests.append((method, name if name is not None else path))
            if name is None:
                return None
            for fault in self.faults:
                on_arrival = fault.mode == "stall" and not fault.min_bytes
                if on_arrival != (answer_bytes is None) or fault.method != method \
                        or fault.contains not in name or (answer_bytes or 0) < fault.min_bytes:
                    continue
                fault.seen += 1
                if fault.nth <= fault.seen < fault.nth + fault.count:
                    fault.hit.append((method, name))
                    return fault
        return None

    def sent(self, method: str, n: int):
        with self.lock:
            self.bytes_sent[method] = self.bytes_sent.get(method, 0) + n

    def stop(self):
        self.stopping.set()
        super().stop()


class _Handler(QuietHandler):
    server: SlowProxy

    def answer(self, body: bytes):
        fault = self.server.fault_for(self.command, self.path)
        if fault is not None:
            self.server.stopping.wait()     # never answered; the connection closes when the proxy stops
            self.close_connection = True
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("connection", "upgrade", "http2-settings")}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            response = upstream.getresponse()
            data = response.read()
        finally:
            upstream.close()
        fault = self.server.fault_for(self.command, self.path, len(data))
        if fault is not None and fault.mode in ("stall", "lose"):
            self.server.stopping.wait()
            self.close_connection = True
            return
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in _HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault is None:
            self.wfile.write(data)
            self.server.sent(self.command, len(data))
            return
        step = max(1, fault.rate // 10)   # ten writes a second
        for start in range(0, len(data), step):
            if self.server.stopping.is_set():
                self.close_connection = True
                return
            try:
                self.wfile.write(data[start:start + step])
                self.wfile.flush()
            except OSError:              # the client gave up on it: what a hedge or deadline does
                self.close_connection = True
                return
            self.server.sent(self.command, len(data[start:start + step]))
            time.sleep(0.1)
