"""Checkpoints under kvstore URLs (``s3://``, ``gs://``, ``memory://``): committed by a marker.

There is no rename, so a save claims the prefix with a ``WRITING`` marker (who, and an id of its
own), writes its arrays under ``arrays/<id>/`` (never where another save writes), then the
manifest (which names that folder), then ``COMMITTED``, which makes it visible. Ownership is
proven by markers (:mod:`dispatch_io.storage.markers`), never guessed from key names: only keys
a dispatch_io save writes are ever deleted, and only under a marker of ours.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

import tensorstore as ts
from absl import logging

from dispatch_io.errors import CheckpointError, CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.storage import (ARRAYS, COMMITTED, DELETING, INFO, MANIFEST, MAX_MANIFEST_BYTES, STEP, WRITING,
                                 JoinedWrite, Location, StepRoot, WriteTarget, manifest_doc)
from dispatch_io.storage.markers import LIVE, Marker
from dispatch_io.workers import brief_error, deadlines, shared_context

# How often, and how patiently, a request to an object store is retried (429, 5xx, connection
# errors) before the save or restore fails: ~80 s of backoff in all, doubling from 1 s. Without a
# bound TensorStore tries 32 times, up to 32 s apart: a dead endpoint would look like a hang for
# a quarter of an hour.
OBJECT_STORE_RETRIES = {"max_retries": 8, "initial_delay": "1s", "max_delay": "16s"}
_RETRY_RESOURCE = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}
_SAVE_ARRAYS = re.compile(re.escape(ARRAYS) + r"[0-9a-f]+/")   # arrays/<save id>/


def kvstore_spec(url: str) -> dict:
    """The TensorStore kvstore spec of a checkpoint URL, with its path ending in ``/``.

    ``s3://bucket/prefix`` also takes the endpoint and region from the environment variables
    boto3 reads (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``; ``AWS_REGION`` or
    ``AWS_DEFAULT_REGION``), so S3-compatible servers (MinIO, moto, ...) work as with other AWS
    tools. Requests are retried as :data:`OBJECT_STORE_RETRIES` says. Credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` when set (what the AWS
    chain would pick first; naming them spares the chain's error lines about files it does not
    find), else TensorStore's AWS chain (~/.aws, instance metadata).

    Raises ValueError for a URL TensorStore does not support.
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
        deadlines.configure()  # the defaults, unless a dispatcher (or the user) set them first
        spec["context"] = {_RETRY_RESOURCE[spec["driver"]]: dict(OBJECT_STORE_RETRIES)}
    return spec


def child_spec(spec: dict, key: str) -> dict:
    """``spec`` with ``key`` appended to its path."""
    return {**spec, "path": spec.get("path", "") + key}


def is_own_key(key: str) -> bool:
    """A key (relative to a checkpoint prefix) that a dispatch_io save or delete writes."""
    return key in (MANIFEST, COMMITTED, WRITING, DELETING, INFO) or key.startswith(ARRAYS)


def _range(prefix: str) -> "ts.KvStore.KeyRange":
    """Every key starting with ``prefix`` (which ends in ``/``)."""
    return ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))


def clear_checkpoint(kv: ts.KvStore, marker_key: str):
    """Delete a checkpoint's own keys under ``kv`` (never anyone else's): ``COMMITTED`` first, so
    it is unlisted at once, then the manifest and arrays, and ``marker_key`` (``WRITING`` of the
    save being undone, or ``DELETING``) last: until then it proves that what is left is ours.
    Raises what the store raises (ValueError)."""
    kv.write(COMMITTED, None).result()
    kv.write(MANIFEST, None).result()
    kv.write(INFO, None).result()
    kv.delete_range(_range(ARRAYS)).result()
    for key in (WRITING, DELETING):
        if key != marker_key:
            kv.write(key, None).result()
    kv.write(marker_key, None).result()


def delete_checkpoint(kv: ts.KvStore):
    """Delete the checkpoint under ``kv``, our own keys only: a ``DELETING`` marker first, so
    that what a crash leaves is still provably ours, then as :func:`clear_checkpoint`."""
    marker = Marker.new()
    with LIVE.live(marker):
        kv.write(DELETING, marker.encode()).result()
        clear_checkpoint(kv, DELETING)


class KvLocation(Location):
    """A checkpoint under the kvstore prefix ``url`` (see the module's docstring).

    Raises ValueError (from :func:`kvstore_spec`) for an unsupported URL. Store failures
    (unreachable, denied, retries exhausted) surface as CheckpointError naming the checkpoint."""

    def __init__(self, url: str):
        self.spec = kvstore_spec(url)
        self.url = url if url.endswith("/") else url + "/"
        self.display = url
        self.context = shared_context(self.spec)
        self._own_context = self.context or ts.Context()  # one S3/GCS client for the markers

    def open_kv(self, sub: str = "") -> ts.KvStore:
        """The kvstore at this prefix (or at ``sub`` under it, ``sub`` ending in ``/``)."""
        return ts.KvStore.open(child_spec(self.spec, sub), context=self._own_context).result()

    def wait(self, future, what: str):
        """A store operation's result; its failure (unreachable, denied, retries exhausted) as a
        CheckpointError naming the checkpoint, the object (``what``) and the request deadline
        that was applied to each attempt."""
        try:
            return future.result()
        except ValueError as exc:
            tried = f" ({deadlines.in_effect()})" if self.spec["driver"] in _RETRY_RESOURCE else ""
            raise CheckpointError(f"{self.display}: could not {what}: {brief_error(exc)}{tried}") from exc

    def read_bounded(self, key: str, limit: int, sub: str = "") -> bytes | None:
        """The value at ``key`` (under ``sub``, ``""`` or ending in ``/``); None if there is none.

        ValueError if it holds more than ``limit`` bytes: one byte past the bound is asked for
        first, so a larger value is never read whole, and a value replaced by a larger one
        after that is refused by its length once read. (TensorStore's byte ranges are exact --
        a range past the end of a shorter value is an error -- so no single ranged read returns
        a value of unknown length up to the bound.) CheckpointError if the store fails."""
        kv = self.open_kv(sub)
        try:
            larger = kv.read(key, byte_range=slice(limit, limit + 1)).result().state == "value"
        except ValueError:  # OUT_OF_RANGE: no larger (any other failure: the read below says)
            larger = False
        result = None if larger else self.wait(kv.read(key), f"read {sub}{key}")
        if larger or result.state == "value" and len(result.value) > limit:
            raise ValueError(f"is larger than {limit} bytes")
        return bytes(result.value) if result.state == "value" else None

    def _get(self, key: str) -> bytes | None:
        result = self.wait(self.open_kv().read(key), f"read {key}")
        return bytes(result.value) if result.state == "value" else None

    def _keys(self) -> list[str]:
        return [k.decode() for k in self.wait(self.open_kv().list(), "list its keys")]

    @property
    def key(self) -> str:
        return self.url

    def arrays_kvstore(self, arrays: str = ARRAYS) -> dict:
        return child_spec(self.spec, arrays)

    def is_committed(self) -> bool:
        return self.commit_marker() is not None

    def commit_marker(self) -> bytes | None:
        return self._get(COMMITTED)

    def read_file(self, key: str) -> bytes | None:
        return self._get(key)

    def read_manifest(self) -> dict:
        marker = self._get(COMMITTED)
        if marker is None:
            if not self._keys():
                raise FileNotFoundError(f"no checkpoint at {self.display}: nothing stored under it")
            raise IncompleteCheckpointError(f"{self.display} holds no committed checkpoint (no {COMMITTED} marker): "
                                            "the save failed, was interrupted, is still running, or this is not a "
                                            "dispatch_io checkpoint")
        try:
            manifest = self.read_bounded(MANIFEST, MAX_MANIFEST_BYTES)
        except ValueError as exc:
            raise CorruptCheckpointError(f"{self.display}: malformed checkpoint: its {MANIFEST} {exc}",
                                         path=self.display) from None
        self.check_commit_marker(marker)  # not a manifest an overwrite wrote meanwhile
        return manifest_doc(manifest, self.display)

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
        if foreign or not Marker.parse(proof).ours:
            shown = ", ".join(sorted(foreign or keys)[:3]) + (", ..." if len(foreign or keys) > 3 else "")
            raise FileExistsError(f"{self.display} holds data that is not part of a dispatch_io checkpoint ({shown}); "
                                  "refusing to replace it, even with overwrite=True (remove it first if it may go)")
        if committed is not None and not overwrite:
            raise FileExistsError(f"a checkpoint is already committed at {self.display}; pass overwrite=True to replace it")
        for key, marker in ((WRITING, writing), (DELETING, deleting)):
            found = Marker.parse(marker)
            if found.alive:
                raise FileExistsError(f"another save or delete of {self.display} is in progress ({key}: "
                                      f"{marker.decode()}); saves to one path never overlap")
            if marker is not None and not found.abandoned and committed is None:
                logging.warning("dispatch_io: taking over %s from an operation that cannot be proven dead (%s: %s)",
                                self.display, key, marker.decode())
        kv = self.open_kv()
        try:
            delete_checkpoint(kv)
        except ValueError as exc:
            raise CheckpointError(f"{self.display}: could not clear it: {brief_error(exc)}") from exc
        return KvWrite(self, kv)

    def join_write(self, token: str) -> JoinedWrite:
        url, _, arrays = token.partition("#")
        if url != self.url or not _SAVE_ARRAYS.fullmatch(arrays):
            raise CheckpointError(f"cannot join the save of {self.display}: {token!r} is not one of its saves")
        return JoinedWrite(self.arrays_kvstore(arrays), self.context, token, arrays)


class KvWrite(WriteTarget):
    """One save on a kvstore. Its ``WRITING`` marker is its claim on the prefix, its arrays go
    to ``arrays/<id>/``: commit and abort act only while the claim is still theirs, and abort
    removes only what this save wrote. While it runs, its id is registered in
    :data:`~dispatch_io.storage.markers.LIVE` (so this process sees its marker alive).

    Creating one writes the claim: FileExistsError if another save claimed the prefix first,
    CheckpointError if the store fails."""

    def __init__(self, location: KvLocation, kv: ts.KvStore):
        self.location = location
        self.kv = kv
        marker = Marker.new()
        self.marker, self.id = marker.encode(), marker.id
        self.arrays = f"{ARRAYS}{self.id}/"
        self.kvstore = location.arrays_kvstore(self.arrays)
        self.context = location.context
        self.token = f"{location.url}#{self.arrays}"
        self._committing = False  # the manifest / COMMITTED may be this save's
        self._files: tuple[str, ...] = ()  # the files it wrote beside the manifest
        LIVE.add(self.id)
        try:
            if not self._write_if_absent(WRITING, self.marker):
                raise FileExistsError(f"another save to {location.display} claimed it first; saves to one path "
                                      "never overlap")
        except BaseException:
            LIVE.discard(self.id)
            raise

    def _write_if_absent(self, key: str, value: bytes) -> bool:
        """Write ``key`` only if it does not exist (a conditional write: atomic where the store
        has them); False if another writer got there first. ``value`` must be unique to this
        writer (a marker): it is what tells a retried write of ours from another's."""
        current = self.location.wait(self.kv.read(key), f"read {key}")
        if current.state == "value":
            return False
        stamp = self.location.wait(self.kv.write(key, value, if_equal=current.stamp.generation), f"write {key}")
        if stamp.generation:
            return True
        # The condition failed -- or an attempt of ours landed and its answer was lost, and the
        # request, sent again (a deadline, a reset), found our own value: ``value`` is unique to
        # this writer (a marker with an id of its own), so finding it proves the write was ours.
        return self.location.wait(self.kv.read(key), f"read {key}").value == value

    def _still_ours(self) -> bool:
        return self.location._get(WRITING) == self.marker

    def _taken_over(self) -> CheckpointError:
        return CheckpointError(f"another save to {self.location.display} started while this one was writing; "
                               "nothing was committed (saves to one path must not overlap)")

    def superseded(self) -> Exception | None:
        try:
            ours = self._still_ours()
        except Exception:  # noqa: BLE001 - the store failing: the save's own error says it
            return None
        return None if ours else self._taken_over()

    def commit(self, manifest: bytes, fsync: bool = True, files: Mapping[str, bytes] | None = None):
        where = self.location.display
        if not self._still_ours():
            raise self._taken_over()
        if self.location._get(COMMITTED) is not None:
            raise CheckpointError(f"another save committed {where} while this one was writing; nothing was committed")
        self._committing = True
        self._files = tuple(files or ())
        for name, data in (files or {}).items():
            self.location.wait(self.kv.write(name, data), f"write {name}")
        self.location.wait(self.kv.write(MANIFEST, manifest), f"write {MANIFEST}")
        if not self._write_if_absent(COMMITTED, Marker.new().encode()):
            self._committing = False  # that COMMITTED is not ours to remove
            raise CheckpointError(f"another save committed {where} while this one was committing; nothing was committed")
        LIVE.discard(self.id)
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
                for name in (MANIFEST, *self._files):
                    self.kv.write(name, None).result()
            self.kv.write(WRITING, None).result()
        finally:
            LIVE.discard(self.id)


class KvRoot(StepRoot):
    """A manager's steps under a kvstore prefix: a step is listed once its ``COMMITTED`` marker
    (one of ours) exists, and a deleted step loses that marker before anything else. Store
    failures raise what the store raises (ValueError)."""

    def __init__(self, location: KvLocation):
        self.location = location
        self.url, self.display = location.url, location.display
        self.kv = location.open_kv()

    def step_path(self, step: int) -> str:
        return f"{self.url}{step}"

    def step_keys(self, listed=None) -> dict[int, set[str]]:
        """Every step-named prefix and the keys under it (relative to it), ours or not: listed,
        or from ``listed`` (this root as a :class:`~dispatch_io.storage.folders.KvFolder`)."""
        keys = [k.decode() for k in self.kv.list().result()] if listed is None else listed.keys()
        steps: dict[int, set[str]] = {}
        for key in keys:
            name, _, rest = key.partition("/")
            if STEP.match(name) and rest:
                steps.setdefault(int(name), set()).add(rest)
        return steps

    def _read_all(self, keys: list[str]) -> list[Marker]:
        """The markers at ``keys`` (read together; an empty Marker where there is none)."""
        reads = [self.kv.read(key) for key in keys]  # in flight together
        return [Marker.parse(bytes(r.value) if r.state == "value" else None) for r in (f.result() for f in reads)]

    def committed_steps(self, listed=None) -> list[int]:
        candidates = [step for step, keys in self.step_keys(listed).items() if {COMMITTED, MANIFEST} <= keys]
        markers = self._read_all([f"{step}/{COMMITTED}" for step in candidates])
        return sorted(step for step, marker in zip(candidates, markers) if marker.ours)

    def delete(self, step: int):
        delete_checkpoint(self.location.open_kv(f"{step}/"))  # COMMITTED first: unlisted at once

    def remove_leftovers(self):
        """Uncommitted step prefixes our markers prove ours and abandoned: an unfinished delete
        (``DELETING``) or save (``WRITING``) of a process of this host that no longer runs it.
        Only our own keys are removed."""
        steps = [step for step, keys in self.step_keys().items()
                 if COMMITTED not in keys and (DELETING in keys or WRITING in keys)]
        deleting = self._read_all([f"{step}/{DELETING}" for step in steps])
        writing = self._read_all([f"{step}/{WRITING}" for step in steps])
        for step, d, w in zip(steps, deleting, writing):
            if d.abandoned or w.abandoned:
                try:
                    self.delete(step)
                except ValueError:
                    logging.exception("dispatch_io: could not clean up %s%s/", self.url, step)
