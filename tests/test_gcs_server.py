"""The GCS test server itself: it must refuse a failed precondition (412) as GCS does, or the
object-store tests that run on it (tests/test_object_store.py) would prove nothing about our
commit protocol. fake-gcs-server alone does not (shown below), so the fixture puts our
precondition layer (tests/servers/gcs_server.py) in front of it; both are tested here."""

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
import tensorstore as ts

from dispatch_io.storage import kvstore_spec
from gcs_server import object_of, precondition_holds


def upload(endpoint: str, name: str, data: bytes, **conditions) -> int:
    """A media upload of ``name`` to bucket ``ckpts``; the HTTP status answered."""
    query = urllib.parse.urlencode({"uploadType": "media", "name": name, **conditions})
    request = urllib.request.Request(f"{endpoint}/upload/storage/v1/b/ckpts/o?{query}", data=data, method="POST",
                                     headers={"Content-Type": "application/octet-stream"})
    return status_of(request)


def delete(endpoint: str, name: str, **conditions) -> int:
    query = urllib.parse.urlencode(conditions)
    request = urllib.request.Request(f"{endpoint}/storage/v1/b/ckpts/o/{urllib.parse.quote(name, safe='')}?{query}",
                                     method="DELETE")
    return status_of(request)


def status_of(request) -> int:
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def generation(endpoint: str, name: str) -> int:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/ckpts/o/{urllib.parse.quote(name, safe='')}") as response:
        return int(json.load(response)["generation"])


def content(endpoint: str, name: str) -> bytes:
    with urllib.request.urlopen(f"{endpoint}/storage/v1/b/ckpts/o/{urllib.parse.quote(name, safe='')}?alt=media") as r:
        return r.read()


def test_fake_gcs_server_alone_ignores_if_generation_match_0(gcs_server, gcs_prefix):
    """Why the layer exists: fake-gcs-server 0.1.1 overwrites an existing object on an upload
    with ``ifGenerationMatch=0`` (GCS answers 412). Should this fail after an upgrade, the
    server enforces preconditions itself and the layer may go."""
    raw, name = gcs_server.emulator.endpoint, gcs_prefix[len("gs://ckpts/"):] + "/x"
    assert upload(raw, name, b"first", ifGenerationMatch=0) == 200
    assert upload(raw, name, b"second", ifGenerationMatch=0) == 200
    assert content(raw, name) == b"second"


def test_the_server_refuses_failed_preconditions(gcs_server, gcs_prefix):
    """Through the fixture's endpoint, uploads and deletes are conditional as on GCS: a second
    create-only upload, an upload or delete of a stale generation are 412 and change nothing."""
    endpoint, name = gcs_server.endpoint, gcs_prefix[len("gs://ckpts/"):] + "/x"
    assert upload(endpoint, name, b"first", ifGenerationMatch=0) == 200
    first = generation(endpoint, name)
    assert upload(endpoint, name, b"second", ifGenerationMatch=0) == 412
    assert content(endpoint, name) == b"first"
    assert upload(endpoint, name, b"second", ifGenerationMatch=first) == 200
    second = generation(endpoint, name)
    assert second != first
    assert upload(endpoint, name, b"third", ifGenerationMatch=first) == 412
    assert upload(endpoint, name, b"third", ifGenerationNotMatch=second) == 412
    assert delete(endpoint, name, ifGenerationMatch=first) == 412
    assert content(endpoint, name) == b"second"
    assert delete(endpoint, name, ifGenerationMatch=second) in (200, 204)
    assert delete(endpoint, name, ifGenerationMatch=second) == 412   # gone: its generation is 0
    assert upload(endpoint, name, b"fourth") == 200                   # unconditional: as before
    assert ("POST", name) in gcs_server.refused and ("DELETE", name) in gcs_server.refused


def test_a_read_of_an_unchanged_generation_is_not_modified(gcs_server, gcs_prefix):
    """GCS answers a read with ``ifGenerationNotMatch`` of the current generation 304 (how a
    reader checks a file was not replaced); fake-gcs-server alone sends the object."""
    name = gcs_prefix[len("gs://ckpts/"):] + "/x"
    assert upload(gcs_server.endpoint, name, b"data") == 200
    current = generation(gcs_server.endpoint, name)

    def read(endpoint, **conditions):
        query = urllib.parse.urlencode({"alt": "media", **conditions})
        return status_of(f"{endpoint}/storage/v1/b/ckpts/o/{urllib.parse.quote(name, safe='')}?{query}")
    assert read(gcs_server.emulator.endpoint, ifGenerationNotMatch=current) == 200    # the emulator alone
    assert read(gcs_server.endpoint, ifGenerationNotMatch=current) == 304
    assert read(gcs_server.endpoint, ifGenerationNotMatch=current + 1) == 200
    assert read(gcs_server.endpoint, ifGenerationMatch=current + 1) == 412
    kv = ts.KvStore.open(kvstore_spec(gcs_prefix)).result()
    stamp = kv.read("x").result().stamp.generation
    assert kv.read("x", if_not_equal=stamp).result().state == "unspecified"   # TensorStore: unchanged


def test_tensorstore_conditional_writes_hold_on_the_server(gcs_prefix):
    """What dispatch_io's claims and commit markers rest on, through TensorStore's gcs driver:
    a write conditioned on absence, or on a generation that is no longer current, fails."""
    kv = ts.KvStore.open(kvstore_spec(gcs_prefix)).result()
    absent = kv.read("COMMITTED").result().stamp.generation   # TensorStore's "no value" generation
    assert kv.write("COMMITTED", b"a", if_equal=absent).result().generation   # absent: written
    assert not kv.write("COMMITTED", b"b", if_equal=absent).result().generation
    stamp = kv.read("COMMITTED").result().stamp.generation
    kv.write("COMMITTED", b"c", if_equal=stamp).result()
    assert not kv.write("COMMITTED", b"d", if_equal=stamp).result().generation
    assert bytes(kv.read("COMMITTED").result().value) == b"c"


@pytest.mark.parametrize("method,path,expected", [
    ("POST", "/upload/storage/v1/b/ckpts/o?uploadType=media&name=a%2Fb%2FCOMMITTED&ifGenerationMatch=0",
     ("ckpts", "a/b/COMMITTED", {"uploadType": "media", "name": "a/b/COMMITTED", "ifGenerationMatch": "0"})),
    ("DELETE", "/storage/v1/b/ckpts/o/a%2Fb%20c?ifGenerationMatch=7",
     ("ckpts", "a/b c", {"ifGenerationMatch": "7"})),
    ("GET", "/storage/v1/b/ckpts/o/a%2Fb?alt=media", ("ckpts", "a/b", {"alt": "media"})),
    ("GET", "/storage/v1/b/ckpts/o?prefix=a%2F", None),
])
def test_the_layer_recognises_changes_of_an_object(method, path, expected):
    assert object_of(method, path) == expected


def test_precondition_rules_are_those_of_gcs():
    assert precondition_holds({}, 5) and precondition_holds({"ifGenerationMatch": "0"}, 0)
    assert not precondition_holds({"ifGenerationMatch": "0"}, 5)
    assert precondition_holds({"ifGenerationMatch": "5"}, 5) and not precondition_holds({"ifGenerationMatch": "5"}, 6)
    assert not precondition_holds({"ifGenerationNotMatch": "5"}, 5) and precondition_holds({"ifGenerationNotMatch": "5"}, 0)
