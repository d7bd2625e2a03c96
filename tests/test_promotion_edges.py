"""Adversarial review of promotion (``mgr.promote``, ``LocalTier(promote=True)``): each test is a
finding that fails on the current code and passes once it is fixed. One process, 8 CPU devices."""

import os
import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from conftest import fail_batches_of, hooked_dispatcher
from dispatch_io import policies


def _state(mesh, step):
    sharded, replicated = NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P())
    return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) * (step + 1), sharded),
            "b": jax.device_put(np.arange(64, dtype=np.int32) - step, replicated)}


def _same(restored, expected):
    for key in expected:
        assert np.asarray(restored[key]).tobytes() == np.asarray(expected[key]).tobytes(), key


@pytest.mark.parametrize("layout", ["files", "ocdbt"])
def test_a_damaged_compressed_local_chunk_is_not_promoted(tmp_path, mesh, layout):
    """Finding: with compression (zstd) the promotion copies a damaged local chunk unchecked and
    commits the step: it is listed, ``durability`` says "persisted", and any restore of it fails
    (measured: WorkerError reading ['w']). The local copy was saved with checksums=True, so its
    CRC-32Cs (of the decoded chunks) are in its manifest, but they are only checked where the stored
    bytes are the raw chunk. Why it matters: the root is the durable tier; local retention then
    deletes the local copy, so the job's only persisted copy of that step is unreadable, and nothing
    said so at promotion time (the uncompressed path fails cleanly, naming the key path). Fix:
    decode compressed chunks that carry a CRC-32C (or at least zstd-validate the frame) before
    writing them, and fail the promotion naming the key path, committing nothing."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True, compression="zstd", layout=layout)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, local=tier) as mgr:
        mgr.local.save(7, _state(mesh, 7)).wait()
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "7", "['w']")[(1, 0)], 10)
        try:
            with pytest.raises(dio.CheckpointError, match=r"\['w'\]"):
                mgr.promote(7).wait()
        finally:
            try:
                mgr.wait()
            except dio.CheckpointError:
                pass
        assert mgr.persistent_steps() == [] and mgr.durability(7) != "persisted"
    dispatcher.close()


def test_a_truncated_local_chunk_is_not_promoted_without_checksums(tmp_path, mesh):
    """Finding: with default options (checksums=False, no compression) a local chunk cut short (the
    torn write on a full RAM disk the local tier's docs name as its failure model) is copied as is
    and the step committed to the root: listed, "persisted", and every restore of it fails
    (measured: WorkerError/FAILED_PRECONDITION reading ['w']). The expected length of a raw chunk is
    known from the manifest (chunk shape x itemsize), so the check is free. Fix: check each raw
    chunk's length against its stored array's chunk shape and dtype (and decode compressed ones)
    before writing; fail the promotion naming the key path, committing nothing."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}")
    dispatcher = dio.LocalDispatcher(small_leaf_bytes=0, layout="files")
    with dio.CheckpointManager(tmp_path / "root", dispatcher, local=tier) as mgr:
        mgr.local.save(7, _state(mesh, 7)).wait()
        value = sh.chunks(tmp_path / "local" / "0" / "7", "['w']")[(1, 0)]
        os.truncate(value.file, value.length // 2)
        try:
            with pytest.raises(dio.CheckpointError, match=r"\['w'\]"):
                mgr.promote(7).wait()
        finally:
            try:
                mgr.wait()
            except dio.CheckpointError:
                pass
        assert mgr.persistent_steps() == [] and mgr.durability(7) != "persisted"
    dispatcher.close()


def test_a_failed_local_save_with_promote_is_reported_once_and_the_next_save_persists(tmp_path, mesh):
    """Finding: ``LocalTier(promote=True)``, the local save of step 1 fails (ENOSPC on the RAM
    disk). ``mgr.wait()`` raises it (from the local tier), but the promotion that then found no
    local copy stores its own FileNotFoundError, which the *next, healthy* ``save(2)`` raises
    ("no process has a local copy of step 1") -- after saving step 2 locally and before starting its
    persistent save, so step 2 never reaches the root. One failure is reported twice, the second
    time by an unrelated save that is silently half-done. A training loop that logs the failure
    from wait() and carries on (the disk was cleaned) crashes at the next save. Fix: report the
    failed step's error once (wait() raising the local failure should consume the promotion's
    consequent error too, or raise the promotion's error with the local one as its cause), and let
    save(2) go through."""
    dispatcher = hooked_dispatcher(dio.LocalDispatcher, write_hook=fail_batches_of(None), small_leaf_bytes=0)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        mgr.save(1, _state(mesh, 1))
        with pytest.raises(dio.CheckpointError, match="No space left"):
            mgr.wait()
        dispatcher.runner.write_hook = None          # the disk was cleaned: the job goes on
        mgr.save(2, _state(mesh, 2))
        mgr.wait()
        assert mgr.persistent_steps() == [2]
        _same(mgr.restore(2, _state(mesh, 0)), _state(mesh, 2))
    dispatcher.close()


def test_the_promote_on_save_handle_honours_wait_timeout(tmp_path, mesh):
    """Finding: the handle ``save()`` returns with ``LocalTier(promote=True)`` (``promotion.Deferred``)
    ignores ``wait(timeout)`` while the local save is in flight: it blocks on the Deferred's lock,
    which the manager's thread holds while it waits, without a timeout, for the local save (and then
    starts the promotion). ``SaveHandle.wait(timeout)`` raises TimeoutError after ``timeout``; a
    loop polling ``handle.wait(timeout=...)`` (to log progress, or to bound a preemption grace
    period) hangs for the whole local save instead (here 6 s for a 0.5 s timeout). Fix: wait for
    the local save with the remaining timeout outside the lock (or on an event), raising
    TimeoutError as SaveHandle does."""
    gate = threading.Event()

    def hold(regions):
        assert gate.wait(60)
    dispatcher = hooked_dispatcher(dio.LocalDispatcher, write_hook=hold, small_leaf_bytes=0)
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        handle = mgr.save(1, _state(mesh, 1))
        timer = threading.Timer(6, gate.set)
        timer.start()
        began = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                handle.wait(timeout=0.5)
            took = time.monotonic() - began
        finally:
            gate.set()
            timer.cancel()
        assert took < 3, took
        handle.wait()
        assert mgr.persistent_steps() == [1]
    dispatcher.close()


def test_the_promote_on_save_handle_names_the_persistent_step(tmp_path, mesh):
    """Finding: with ``LocalTier(promote=True)``, ``save()``'s handle (``promotion.Deferred``) has
    ``path`` = the *local* copy (``<local>/0/1``, ``Deferred.path`` returns the local save's), while
    the same save without promote returns a handle whose ``path`` is the root's step. The handle
    stands for the persistent save (its ``wait()`` is the promotion's); code that logs, verifies
    or uploads ``handle.path`` acts on the node-local RAM-disk copy, which local retention deletes.
    Fix: ``Deferred.path`` is the persistent step's path (``after`` is given it as ``path``)."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", save_policy=policies.EveryNSteps(1), local=tier) as mgr:
        handle = mgr.save(1, _state(mesh, 1))
        handle.wait()
        assert handle.path == os.fspath(tmp_path / "root" / "1")


def test_save_with_promote_raises_file_exists_before_writing(tmp_path, mesh):
    """Finding: ``save()`` documents FileExistsError "before anything is written" for a step the
    root already holds (without overwrite), and does so without promote. With
    ``LocalTier(promote=True)`` ``save(2, ..., force=True)`` returns a handle: the local copy of
    step 2 is (over)written with the new state, and the FileExistsError only comes out of the next
    ``wait()``/``save()``, from the manager's thread. A caller relying on save() to refuse (e.g. a
    resumed loop re-saving its restored step) gets a late error from an unrelated call, and a local
    step 2 that differs from the root's. Fix: check the root step's writability in ``save()`` (as
    ``Dispatcher.save`` does) before starting the local save or deferring the promotion."""
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(1), promote=True)
    with dio.CheckpointManager(tmp_path / "root", local=tier) as mgr:
        mgr.save(2, _state(mesh, 2), local=False)
        mgr.wait()
        assert mgr.persistent_steps() == [2]
        try:
            with pytest.raises(FileExistsError):
                mgr.save(2, _state(mesh, 5), force=True)
        finally:
            try:
                mgr.wait()
            except FileExistsError:
                pass
        _same(mgr.restore(2, _state(mesh, 0)), _state(mesh, 2))
