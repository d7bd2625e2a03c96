"""Where a checkpoint lives, and how it is committed.

A path maps to a :class:`Location`:

* a local directory (``str`` / ``os.PathLike``, relative or absolute, or ``file://``): data is
  written into a temporary sibling ``.<name>.dispatch_io-tmp-<id>`` (one per save, marked with
  a ``WRITING`` file that says who made it), files and directories are
  fsynced, ``manifest.json`` then ``COMMITTED`` are written last, and the directory is renamed
  into place. Nothing at ``path`` is ever half-written.
* a kvstore URL: ``s3://bucket/prefix``, ``gs://bucket/prefix`` (object stores) or ``memory://``
  (tests): there is no rename, so a save claims the prefix (``WRITING``), writes its arrays under
  ``arrays/<save id>/`` and the ``COMMITTED`` marker, written last, is what makes it visible.
  Readers and listings ignore a prefix without it; an overwrite deletes the old marker first.
  See :class:`KvLocation`.

Both layouts are identical once committed::

    <path>/manifest.json   versioned description of the tree (see manifest.py)
    <path>/arrays/<name>/  one zarr3 array per stored leaf
    <path>/COMMITTED       written last
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
import uuid

import tensorstore as ts
from absl import logging

from dispatch_io.errors import CheckpointError, IncompleteCheckpointError
from workers import shared_context

MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
WRITING = "WRITING"        # ownership marker inside our temporary directories / of a save under way
DELETING = "DELETING"      # kvstores: a checkpoint being deleted (what is left is provably ours)
ARRAYS = "arrays/"
TMP_SUFFIX = ".dispatch_io-tmp"

def _fsync_path(path: str, directory: bool = False):
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _process_start(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot), or None if there is no such
    process. With the pid it identifies a process even after its pid is reused."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def marker_json() -> bytes:
    """Who wrote a marker; ``id`` makes every commit's ``COMMITTED`` unique."""
    return json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": _process_start(os.getpid()),
                       "time": time.time(), "id": uuid.uuid4().hex}).encode()


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def marker_is_ours(marker: bytes | None) -> bool:
    """The bytes of a WRITING / COMMITTED marker written by dispatch_io."""
    try:
        return {"host", "pid", "id"} <= set(json.loads(marker))
    except (ValueError, TypeError):
        return False


def marker_is_stale(marker: bytes | None) -> bool:
    """True only if ``marker`` is one of ours and the process that wrote it provably no longer
    runs (same host; that pid is gone or belongs to a later process)."""
    try:
        fields = json.loads(marker)
        host, pid, started = fields["host"], int(fields["pid"]), fields["started"]
    except (ValueError, KeyError, TypeError):
        return False
    if host != socket.gethostname() or started is None:
        return False
    return _process_start(pid) != started


def is_our_marker(marker_path: str) -> bool:
    return marker_is_ours(_read(marker_path))


def writer_is_gone(marker_path: str) -> bool:
    return marker_is_stale(_read(marker_path))


class WriteTarget:
    """An in-progress save: workers write arrays under ``kvstore``; then :meth:`commit` or :meth:`abort`.

    ``token`` lets other processes of a multi-process job join it (``Location.join_write``)."""

    kvstore: dict
    context: ts.Context | None
    token: str
    arrays: str = ARRAYS   # where, relative to the checkpoint, ``kvstore`` is (the manifest says it)

    def commit(self, manifest: bytes, fsync: bool = True):
        raise NotImplementedError

    def abort(self):
        raise NotImplementedError


class Location:
    """A checkpoint path. ``Location.parse`` picks the implementation."""

    display: str
    context: ts.Context | None = None  # shared TensorStore context (None: each session makes its own)

    @staticmethod
    def parse(path) -> "Location":
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise TypeError(f"checkpoint path must be a non-empty str or os.PathLike, got {path!r}")
        if path.startswith("file://"):
            return DirectoryLocation(path[len("file://"):])
        if "://" in path:
            return KvLocation(path)
        return DirectoryLocation(path)

    @property
    def key(self) -> str:
        """Identifies the checkpoint location (saves to one key are serialized)."""
        raise NotImplementedError

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        """The kvstore of the checkpoint's ``arrays`` (``Manifest.arrays``)."""
        raise NotImplementedError

    def is_committed(self) -> bool:
        raise NotImplementedError

    def read_manifest(self) -> dict:
        raise NotImplementedError

    def commit_marker(self) -> bytes | None:
        """The ``COMMITTED`` marker's bytes (unique per commit), or None if there is none."""
        raise NotImplementedError

    def check_commit_marker(self, marker: bytes | None, cause: BaseException | None = None):
        """CheckpointError if the checkpoint is no longer the one whose marker was ``marker``:
        another save replaced it while it was being read, so what was read may mix the two."""
        if self.commit_marker() != marker:
            raise CheckpointError(f"the checkpoint at {self.display} was replaced by another save while "
                                  "it was being restored; restore it again") from cause

    def start_write(self, overwrite: bool) -> WriteTarget:
        raise NotImplementedError

    def join_write(self, token: str) -> WriteTarget:
        """The save another process started (its target's ``token``): this process only
        writes arrays into it; the process that started it commits or aborts."""
        raise NotImplementedError


class JoinedWrite(WriteTarget):
    def __init__(self, kvstore: dict, context, token: str):
        self.kvstore, self.context, self.token = kvstore, context, token

    def commit(self, manifest: bytes, fsync: bool = True):
        raise RuntimeError("only the process that started a save commits it")

    def abort(self):
        pass  # the process that started the save removes it


# ---- local directories ------------------------------------------------------------------------

class DirectoryLocation(Location):
    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        self.display = path

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        return {"driver": "file", "path": os.path.join(self.path, arrays)}

    def is_committed(self) -> bool:
        return os.path.isfile(os.path.join(self.path, COMMITTED))

    def commit_marker(self) -> bytes | None:
        return _read(os.path.join(self.path, COMMITTED))

    def read_manifest(self) -> dict:
        if not os.path.exists(self.path):
            raise FileNotFoundError(f"no checkpoint at {self.display}: the path does not exist")
        if not os.path.isdir(self.path):
            raise IncompleteCheckpointError(f"{self.display} is a file, not a checkpoint directory")
        if not self.is_committed():
            raise IncompleteCheckpointError(
                f"{self.display} holds no committed checkpoint (no {COMMITTED} marker): "
                "the save failed, was interrupted, is still running, or this is not a dispatch_io checkpoint")
        try:
            with open(os.path.join(self.path, MANIFEST), "rb") as f:
                return json.loads(f.read())
        except (OSError, ValueError) as exc:
            raise IncompleteCheckpointError(f"{self.display} is marked committed but its {MANIFEST} "
                                            f"cannot be read: {exc}") from exc

    @property
    def key(self) -> str:
        return self.path

    def check_writable(self, overwrite: bool):
        """FileExistsError unless nothing (or an empty directory) is at the path, or a committed
        checkpoint and ``overwrite``. Anything else (a file, a directory of other things) is never
        replaced: ``overwrite=True`` on a mistyped path must not delete someone's data."""
        if not os.path.lexists(self.path):
            return
        if self.is_committed():
            if not overwrite:
                raise FileExistsError(f"a checkpoint is already committed at {self.display}; pass overwrite=True to replace it")
            return
        if not os.path.isdir(self.path) or os.path.islink(self.path) or os.listdir(self.path):
            raise FileExistsError(f"{self.display} exists and is not a dispatch_io checkpoint; refusing to "
                                  "replace it, even with overwrite=True (remove it first if it may go)")

    def start_write(self, overwrite: bool) -> "DirectoryWrite":
        self.check_writable(overwrite)
        return DirectoryWrite(self, overwrite)

    def join_write(self, token: str) -> JoinedWrite:
        parent, name = os.path.split(self.path)
        tmp = os.path.join(parent, token)
        if not (token.startswith(f".{name}{TMP_SUFFIX}-") and os.path.isfile(os.path.join(tmp, WRITING))):
            raise CheckpointError(f"cannot join the save of {self.display}: {tmp} is not its temporary directory "
                                  "(do all processes see the same file system?)")
        return JoinedWrite({"driver": "file", "path": os.path.join(tmp, ARRAYS)}, None, token)


class DirectoryWrite(WriteTarget):
    def __init__(self, location: DirectoryLocation, overwrite: bool):
        self.location = location
        self.overwrite = overwrite
        parent, name = os.path.split(location.path)
        os.makedirs(parent, exist_ok=True)
        # One directory per save: two saves of one path never share (or delete) each other's data.
        self.token = f".{name}{TMP_SUFFIX}-{uuid.uuid4().hex[:12]}"
        self.tmp = os.path.join(parent, self.token)
        os.makedirs(os.path.join(self.tmp, ARRAYS))
        try:
            with open(os.path.join(self.tmp, WRITING), "wb") as f:
                f.write(marker_json())
        except BaseException:
            self.abort()
            raise
        self.kvstore = {"driver": "file", "path": os.path.join(self.tmp, ARRAYS)}
        self.context = None

    def commit(self, manifest: bytes, fsync: bool = True):
        final = self.location.path
        _write_file(os.path.join(self.tmp, MANIFEST), manifest, fsync)
        if fsync:
            for root, dirs, _ in os.walk(self.tmp):
                for d in dirs:
                    _fsync_path(os.path.join(root, d), directory=True)
        _write_file(os.path.join(self.tmp, COMMITTED), marker_json(), fsync)
        # Only now: until the rename, one of the two markers always names this process, so a
        # manager can prove the directory a leftover if this process is killed.
        os.remove(os.path.join(self.tmp, WRITING))
        if fsync:
            _fsync_path(self.tmp, directory=True)
        self.location.check_writable(self.overwrite)  # again: another save may have committed meanwhile
        old = None
        if os.path.lexists(final):
            old = f"{final}.dispatch_io-old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
        try:
            os.rename(self.tmp, final)
        except BaseException:
            if old is not None:  # put the replaced checkpoint back rather than lose it
                os.rename(old, final)
            raise
        if fsync:
            _fsync_path(os.path.dirname(final), directory=True)
        if old is None:
            return
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old, ignore_errors=True)
        else:  # a file, or a link to a checkpoint: the link goes, the checkpoint it named stays
            os.remove(old)

    def abort(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_file(path: str, data: bytes, fsync: bool):
    with open(path, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


# ---- kvstore URLs (memory://, s3://, gs://) --------------------------------------------------------

# How often, and how patiently, a request to an object store is retried (429, 5xx, connection
# errors) before the save or restore fails: ~80 s of backoff in all, doubling from 1 s. Without a
# bound TensorStore tries 32 times, up to 32 s apart: a dead endpoint would look like a hang for
# a quarter of an hour.
OBJECT_STORE_RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "16s"}
_RETRY_RESOURCE = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}


def kvstore_spec(url: str) -> dict:
    """The TensorStore kvstore spec of a checkpoint URL, with its path ending in ``/``.

    ``s3://bucket/prefix`` also takes the endpoint and region from the environment variables
    boto3 reads (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``; ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION``), so S3-compatible servers (MinIO, moto, ...) work as with other AWS
    tools. Requests are retried as :data:`OBJECT_STORE_RETRIES` says. Credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` when set (what the AWS
    chain would pick first; naming them spares the chain's error lines about files it does not
    find), else TensorStore's AWS chain (~/.aws, instance metadata).
    """
    url = url if url.endswith("/") else url + "/"
    try:
        spec = ts.KvStore.Spec(url).to_json()
    except ValueError as exc:
        raise ValueError(f"unsupported checkpoint URL {url!r}: use a directory, memory://, s3://bucket/prefix "
                         f"or gs://bucket/prefix ({exc})") from None
    if spec["driver"] == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if endpoint:
            spec["endpoint"] = endpoint.rstrip("/")
        if region:
            spec["aws_region"] = region
        if os.environ.get("AWS_ACCESS_KEY_ID"):
            spec["aws_credentials"] = {"type": "environment"}
    if spec["driver"] in _RETRY_RESOURCE:
        spec["context"] = {_RETRY_RESOURCE[spec["driver"]]: dict(OBJECT_STORE_RETRIES)}
    return spec


def child_spec(spec: dict, key: str) -> dict:
    """``spec`` with ``key`` appended to its path."""
    return {**spec, "path": spec.get("path", "") + key}


def is_own_key(key: str) -> bool:
    """A key (relative to a checkpoint prefix) that a dispatch_io save or delete writes."""
    return key in (MANIFEST, COMMITTED, WRITING, DELETING) or key.startswith(ARRAYS)


def _range(prefix: str) -> "ts.KvStore.KeyRange":
    """Every key starting with ``prefix`` (which ends in ``/``)."""
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def clear_checkpoint(kv, marker_key: str):
    """Delete a checkpoint's own keys under ``kv`` (never anyone else's): ``COMMITTED`` first, so
    it is unlisted at once, then the manifest and arrays, and ``marker_key`` (``WRITING`` of the
    save being undone, or ``DELETING``) last: until then it proves that what is left is ours."""
    kv.write(COMMITTED, None).result()
    kv.write(MANIFEST, None).result()
    kv.delete_range(_range(ARRAYS)).result()
    for key in (WRITING, DELETING):
        if key != marker_key:
            kv.write(key, None).result()
    kv.write(marker_key, None).result()


# Marker ids of this process's kvstore saves and deletes under way: a marker naming this process
# but none of these was left by an operation of ours that failed; it is no longer alive.
_IN_FLIGHT: set[str] = set()


@contextlib.contextmanager
def _in_flight(marker: bytes):
    """While the block runs, the operation ``marker`` names counts as alive in this process."""
    ticket = json.loads(marker)["id"]
    _IN_FLIGHT.add(ticket)
    try:
        yield
    finally:
        _IN_FLIGHT.discard(ticket)


def delete_checkpoint(kv):
    """Delete the checkpoint under ``kv``, our own keys only: a ``DELETING`` marker first, so
    that what a crash leaves is still provably ours, then as :func:`clear_checkpoint`."""
    marker = marker_json()
    with _in_flight(marker):
        kv.write(DELETING, marker).result()
        clear_checkpoint(kv, DELETING)


def marker_is_alive_here(marker: bytes | None) -> bool:
    """The marker names a process of this host that still runs it (for this process: an
    operation still in flight)."""
    try:
        fields = json.loads(marker)
        if fields["host"] != socket.gethostname():
            return False
        if int(fields["pid"]) == os.getpid():
            return fields["id"] in _IN_FLIGHT
        return _process_start(int(fields["pid"])) == fields["started"]
    except (ValueError, KeyError, TypeError):
        return False


def marker_is_abandoned(marker: bytes | None) -> bool:
    """One of our markers, written on this host by an operation that provably no longer runs."""
    try:
        return json.loads(marker)["host"] == socket.gethostname() and not marker_is_alive_here(marker)
    except (ValueError, KeyError, TypeError):
        return False


class KvLocation(Location):
    """A checkpoint under a kvstore prefix. There is no rename, so a save claims the prefix with
    a ``WRITING`` marker (who, and an id of its own), writes its arrays under ``arrays/<id>/``
    (never where another save writes), then the manifest (which names that folder), then
    ``COMMITTED``, which makes it visible. Ownership is proven by markers, never guessed from
    key names."""

    def __init__(self, url: str):
        self.spec = kvstore_spec(url)
        self.url = url if url.endswith("/") else url + "/"
        self.display = url
        self.context = shared_context(self.spec)
        self._own_context = self.context or ts.Context()  # one S3/GCS client for the markers

    def open_kv(self, sub: str = ""):
        """The kvstore at this prefix (or at ``sub`` under it, ``sub`` ending in ``/``)."""
        return ts.KvStore.open(child_spec(self.spec, sub), context=self._own_context).result()

    def _wait(self, future, what: str):
        """A store operation's result; its failure (unreachable, denied, retries exhausted) as a
        CheckpointError naming the checkpoint."""
        try:
            return future.result()
        except ValueError as exc:
            raise CheckpointError(f"{self.display}: could not {what}: {exc}") from exc

    def _get(self, key: str) -> bytes | None:
        result = self._wait(self.open_kv().read(key), f"read {key}")
        return bytes(result.value) if result.state == "value" else None

    def _keys(self) -> list[str]:
        return [k.decode() for k in self._wait(self.open_kv().list(), "list its keys")]

    @property
    def key(self) -> str:
        return self.url

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        return child_spec(self.spec, arrays)

    def is_committed(self) -> bool:
        return self.commit_marker() is not None

    def commit_marker(self) -> bytes | None:
        return self._get(COMMITTED)

    def read_manifest(self) -> dict:
        marker = self._get(COMMITTED)
        if marker is None:
            if not self._keys():
                raise FileNotFoundError(f"no checkpoint at {self.display}: nothing stored under it")
            raise IncompleteCheckpointError(f"{self.display} holds no committed checkpoint (no {COMMITTED} marker): "
                                            "the save failed, was interrupted, is still running, or this is not a "
                                            "dispatch_io checkpoint")
        manifest = self._get(MANIFEST)
        self.check_commit_marker(marker)  # not a manifest an overwrite wrote meanwhile
        try:
            return json.loads(manifest)
        except (ValueError, TypeError) as exc:
            raise IncompleteCheckpointError(f"{self.display} is marked committed but its {MANIFEST} "
                                            f"cannot be read: {exc}") from exc

    def start_write(self, overwrite: bool) -> "KvWrite":
        """Like a directory: a committed checkpoint is replaced only with ``overwrite``, what a
        dead save left always, anything else never -- ours is what our markers prove ours.

        A save or delete under way in a live process of this host is never taken over. One whose
        marker names another host cannot be proven dead: it is taken over (a preempted job's
        step is saved again after a restart). Should it go on all the same, it writes only its
        own ``arrays/<id>/``, which nothing references, and fails at commit finding its claim gone."""
        keys = self._keys()
        if not keys:
            return KvWrite(self, self.open_kv())
        foreign = [k for k in keys if not is_own_key(k)]
        committed, writing, deleting = self._get(COMMITTED), self._get(WRITING), self._get(DELETING)
        proof = next((m for m in (committed, writing, deleting) if m is not None), None)
        if foreign or not marker_is_ours(proof):
            shown = ", ".join(sorted(foreign or keys)[:3]) + (", ..." if len(foreign or keys) > 3 else "")
            raise FileExistsError(f"{self.display} holds data that is not part of a dispatch_io checkpoint ({shown}); "
                                  "refusing to replace it, even with overwrite=True (remove it first if it may go)")
        if committed is not None and not overwrite:
            raise FileExistsError(f"a checkpoint is already committed at {self.display}; pass overwrite=True to replace it")
        for key, marker in ((WRITING, writing), (DELETING, deleting)):
            if marker_is_alive_here(marker):
                raise FileExistsError(f"another save or delete of {self.display} is in progress ({key}: "
                                      f"{marker.decode()}); saves to one path never overlap")
            if marker is not None and not marker_is_abandoned(marker) and committed is None:
                logging.warning("dispatch_io: taking over %s from an operation that cannot be proven dead (%s: %s)",
                                self.display, key, marker.decode())
        kv = self.open_kv()
        try:
            delete_checkpoint(kv)
        except ValueError as exc:
            raise CheckpointError(f"{self.display}: could not clear it: {exc}") from exc
        return KvWrite(self, kv)

    def join_write(self, token: str) -> JoinedWrite:
        url, _, arrays = token.partition("#")
        if url != self.url or not re.match(r"^arrays/[0-9a-f]+/$", arrays):
            raise CheckpointError(f"cannot join the save of {self.display}: {token!r} is not one of its saves")
        joined = JoinedWrite(self.arrays_kvstore(arrays), self.context, token)
        joined.arrays = arrays
        return joined


class KvWrite(WriteTarget):
    """One save on a kvstore. Its ``WRITING`` marker is its claim on the prefix, its arrays go
    to ``arrays/<id>/``: commit and abort act only while the claim is still theirs, and abort
    removes only what this save wrote."""

    def __init__(self, location: KvLocation, kv):
        self.location = location
        self.kv = kv
        self.marker = marker_json()
        self.id = json.loads(self.marker)["id"]
        self.arrays = f"{ARRAYS}{self.id}/"
        self.kvstore = location.arrays_kvstore(self.arrays)
        self.context = location.context
        self.token = f"{location.url}#{self.arrays}"
        self._committing = False  # the manifest / COMMITTED may be this save's
        _IN_FLIGHT.add(self.id)
        try:
            if not self._write_if_absent(WRITING, self.marker):
                raise FileExistsError(f"another save to {location.display} claimed it first; saves to one path "
                                      "never overlap")
        except BaseException:
            _IN_FLIGHT.discard(self.id)
            raise

    def _write_if_absent(self, key: str, value: bytes) -> bool:
        """Write ``key`` only if it does not exist (a conditional write: atomic where the store
        has them); False if another writer got there first."""
        current = self.location._wait(self.kv.read(key), f"read {key}")
        if current.state == "value":
            return False
        stamp = self.location._wait(self.kv.write(key, value, if_equal=current.stamp.generation), f"write {key}")
        return bool(stamp.generation)  # empty: the condition failed

    def _still_ours(self) -> bool:
        return self.location._get(WRITING) == self.marker

    def commit(self, manifest: bytes, fsync: bool = True):
        where = self.location.display
        if not self._still_ours():
            raise CheckpointError(f"another save to {where} started while this one was writing; "
                                  "nothing was committed (saves to one path must not overlap)")
        if self.location._get(COMMITTED) is not None:
            raise CheckpointError(f"another save committed {where} while this one was writing; nothing was committed")
        self._committing = True
        self.location._wait(self.kv.write(MANIFEST, manifest), f"write {MANIFEST}")
        if not self._write_if_absent(COMMITTED, marker_json()):
            self._committing = False  # that COMMITTED is not ours to remove
            raise CheckpointError(f"another save committed {where} while this one was committing; nothing was committed")
        _IN_FLIGHT.discard(self.id)
        try:  # committed: a WRITING left behind is harmless (the next save clears it)
            self.kv.write(WRITING, None).result()
        except ValueError:
            logging.warning("dispatch_io: %s is committed, but its %s marker could not be removed", where, WRITING)

    def abort(self):
        """Remove what this save wrote and nothing else: its arrays, its manifest and commit
        marker if it got that far (only while its claim stands), and its ``WRITING`` last."""
        try:
            self.kv.delete_range(_range(self.arrays)).result()
            if not self._still_ours():
                logging.warning("dispatch_io: %s was claimed by another save; left it alone", self.location.display)
                return
            if self._committing:
                self.kv.write(COMMITTED, None).result()
                self.kv.write(MANIFEST, None).result()
            self.kv.write(WRITING, None).result()
        finally:
            _IN_FLIGHT.discard(self.id)
