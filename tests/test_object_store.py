"""Checkpoints on object stores: real servers on loopback -- S3 (moto) through TensorStore's s3
driver, GCS (fake-gcs-server behind our precondition layer, tests/servers/gcs_server.py) through its gcs
driver. What holds for directories must hold on both, with a marker instead of a rename: the
tests taking ``store_prefix`` / ``object_store`` run once per store."""

import json
import os
import subprocess
import sys
import threading
import uuid

import jax
import jax.numpy as jnp
import pytest
import tensorstore as ts
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io.storage import KvLocation, Marker, kvstore_spec
from s3_server import FaultyProxy

MiB = 1 << 20


def make_tree(mesh, seed: int = 0):
    shard = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    k = jax.random.split(jax.random.key(seed), 3)
    return {
        "params": {"w": jax.device_put(jax.random.normal(k[0], (256, 128)), shard("data", "model")),
                   "b": jax.device_put(jax.random.normal(k[1], (128,)).astype(jnp.bfloat16), shard("model"))},
        "opt": {"mu": jax.device_put(jax.random.uniform(k[2], (64, 64)), shard("data"))},
        "rng": jax.device_put(jax.random.key(seed + 7), shard()),
        "step": seed + 100,
    }


def like(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                        if isinstance(x, jax.Array) else x, tree)


def keys_under(url: str) -> set[str]:
    """The keys under a kvstore URL (memory:// through the process's shared context)."""
    return set(KvLocation(url)._keys())


def put(url: str, key: str, value: bytes):
    KvLocation(url).open_kv().write(key, value).result()


@pytest.mark.parametrize("dispatcher_cls,layout", [(dio.LocalDispatcher, "ocdbt"), (dio.LocalDispatcher, "files"),
                                                   (dio.ColocatedDispatcher, "ocdbt")],
                         ids=["local-ocdbt", "local-files", "colocated-ocdbt"])
def test_round_trip_on_object_stores(store_prefix, mesh, dispatcher_cls, layout):
    tree, path = make_tree(mesh), f"{store_prefix}/step_1"
    with dispatcher_cls(host_memory_budget=MiB, layout=layout, checksums=True) as d:
        stats = d.save(path, tree).wait()
        assert stats.bytes_written > 256 * 128 * 4
        keys = keys_under(path)
        assert {"manifest.json", "COMMITTED"} <= keys and "WRITING" not in keys, keys
        assert all(k in ("manifest.json", "COMMITTED") or k.startswith("arrays/") for k in keys), keys
        assert KvLocation(path).read_manifest()["layout"] == layout
        assert_trees_bit_equal(d.restore(path, like(tree), verify=True), tree)
        meta = dio.metadata(path)
        assert meta["params"]["w"].shape == (256, 128) and meta["step"] == 100


def test_uncommitted_save_is_invisible_and_a_failed_one_leaves_nothing(store_prefix, mesh):
    tree, root = make_tree(mesh), f"{store_prefix}/run"
    release, paused = threading.Event(), threading.Event()

    def hold(keypath):  # the save cannot commit while a transfer callback blocks
        paused.set()
        release.wait(30)

    with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(root, d) as manager:
        manager.save(1, tree).wait()
        handle = manager.save(2, tree, priority=lambda k, s: dio.Priority.LOW, on_transfer_end=hold)
        assert paused.wait(30)
        assert "2/WRITING" in keys_under(root) and "2/COMMITTED" not in keys_under(root)
        assert manager.all_steps() == [1] and manager.latest_step() == 1
        with pytest.raises(dio.IncompleteCheckpointError, match="no committed checkpoint"):
            dio.metadata(manager.step_path(2))
        assert_trees_bit_equal(manager.restore(target=like(tree)), tree)  # the latest committed: step 1
        release.set()
        handle.wait()
        assert manager.all_steps() == [1, 2]

        doomed = make_tree(mesh, seed=3)
        doomed["opt"]["mu"].delete()  # the save fails on this leaf
        with pytest.raises(dio.WorkerError, match=r"\['opt'\]\['mu'\]"):
            manager.save(3, doomed, priority=lambda k, s: dio.Priority.LOW).wait()
        with pytest.raises(dio.WorkerError):
            manager.wait()  # reported once more by the manager, then cleared
        assert not any(k.startswith("3/") for k in keys_under(root)), keys_under(root)
        assert manager.all_steps() == [1, 2]


def test_overwrite_and_foreign_data(store_prefix, mesh):
    path = f"{store_prefix}/ckpt"
    first, second = make_tree(mesh, 1), make_tree(mesh, 2)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(path, first).wait()
        with pytest.raises(FileExistsError, match="already committed"):
            d.save(path, second)
        assert_trees_bit_equal(d.restore(path, like(first)), first)
        d.save(path, second, overwrite=True).wait()
        assert_trees_bit_equal(d.restore(path, like(second)), second)

        foreign = f"{store_prefix}/someone_elses"
        put(foreign, "data.bin", b"precious")
        with pytest.raises(FileExistsError, match=r"not part of a dispatch_io checkpoint \(data.bin\)"):
            d.save(foreign, first, overwrite=True)
        assert keys_under(foreign) == {"data.bin"}
        with pytest.raises(dio.IncompleteCheckpointError, match="no committed checkpoint"):
            d.restore(foreign, like(first))
        with pytest.raises(FileNotFoundError, match="nothing stored"):
            dio.metadata(f"{store_prefix}/nothing_here")


def test_manager_on_object_stores_lists_retains_and_cleans_up(store_prefix, mesh):
    root = f"{store_prefix}/run"
    put(root, "notes/README", b"not a step")
    put(root, "7/model.bin", b"a numeric prefix that is not ours")
    # Leftovers of saves killed earlier: one by a process that is gone (removed when a manager
    # opens the root), one by a process that still runs -- init, pid 1 (kept).
    gone = json.dumps({"host": os.uname().nodename, "pid": 2 ** 22 + 1, "started": "1", "time": 0, "id": "x"}).encode()
    put(root, "40/WRITING", gone)
    put(root, "40/arrays/manifest.ocdbt", b"partial")
    from dispatch_io.storage.markers import process_start
    alive = json.dumps({"host": os.uname().nodename, "pid": 1, "started": process_start(1), "time": 0, "id": "y"})
    put(root, "41/WRITING", alive.encode())
    put(root, "41/arrays/manifest.ocdbt", b"partial")

    trees = {step: make_tree(mesh, step) for step in range(5)}
    with dio.LocalDispatcher(host_memory_budget=MiB) as d, \
            dio.CheckpointManager(root, d, max_to_keep=2, keep_every_n_steps=2) as manager:
        assert not any(k.startswith("40/") for k in keys_under(root))
        assert {"41/WRITING", "41/arrays/manifest.ocdbt"} <= keys_under(root)
        assert manager.all_steps() == []
        for step, tree in trees.items():
            manager.save(step, tree)
        manager.wait()
        assert manager.all_steps() == [0, 2, 3, 4]
        keys = keys_under(root)
        assert not any(k.startswith("1/") for k in keys), keys
        assert {"notes/README", "7/model.bin"} <= keys
        assert_trees_bit_equal(manager.restore(target=like(trees[4])), trees[4])
        assert_trees_bit_equal(manager.restore(2, like(trees[2])), trees[2])
        assert manager.metadata(3)["step"] == 103

    with dio.CheckpointManager(root, max_to_keep=2) as again:  # a new manager sees the same steps
        assert again.all_steps() == [0, 2, 3, 4] and again.latest_step() == 4


def test_all_steps_lists_an_object_store_root_once(s3_server, s3_prefix, mesh, monkeypatch):
    """One LIST request per ``all_steps()`` (its steps and Orbax's answered from one listing),
    counted at a proxy in front of moto."""
    proxy = FaultyProxy(s3_server.port)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
        tree = make_tree(mesh)
        with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(f"{s3_prefix}/run", d) as manager:
            for step in (1, 2):
                manager.save(step, tree)
            manager.wait()
            with proxy.lock:
                proxy.requests.clear()
            assert manager.all_steps() == [1, 2]
            with proxy.lock:
                lists = [path for method, path in proxy.requests if method == "GET" and "list-type=" in path]
            assert len(lists) == 1, lists
    finally:
        proxy.stop()


def test_a_root_holding_more_keys_than_a_checkpoints_cap_still_lists_and_saves(s3_prefix, mesh, monkeypatch):
    """The cap on the keys of a folder read as a checkpoint (``folders.MAX_LISTED_KEYS``) is not a
    cap on a manager's root, which holds every step's keys: with the cap below the root's keys (but
    above one step's), the root's steps are listed, a step's path found, another step saved and
    a step restored."""
    import dispatch_io.storage.folders as folders
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(f"{s3_prefix}/run", d) as manager:
        for step in (1, 2):
            manager.save(step, tree)
        manager.wait()
        kv = ts.KvStore.open(kvstore_spec(f"{s3_prefix}/run/")).result()
        per_step = len(kv.list(ts.KvStore.KeyRange("1/", "10")).result())
        assert len(kv.list().result()) > per_step + 1
        monkeypatch.setattr(folders, "MAX_LISTED_KEYS", per_step + 1)
        assert manager.all_steps() == [1, 2] and manager.latest_step() == 2
        manager.save(3, tree)
        manager.wait()
        assert manager.all_steps() == [1, 2, 3]
        assert_trees_bit_equal(manager.restore(2, like(tree)), tree)


def test_concurrent_saves_to_one_prefix_have_exactly_one_winner(store_prefix, mesh):
    """Four saves to one prefix started at once, each with its own dispatcher: the conditional
    writes of the claim and the commit marker (412 on GCS, on S3 ``If-None-Match``) let exactly
    one commit; the others fail, and the prefix holds the winner's tree and only its arrays."""
    url, count = f"{store_prefix}/ckpt", 4
    trees = [make_tree(mesh, seed) for seed in range(count)]
    start, outcomes = threading.Barrier(count), [None] * count

    def run(i):
        with dio.LocalDispatcher(host_memory_budget=MiB, checksums=True) as d:
            start.wait(30)
            try:
                d.save(url, trees[i]).wait()
                outcomes[i] = "committed"
            except (FileExistsError, dio.CheckpointError) as exc:
                outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert outcomes.count("committed") == 1 and all(o is not None for o in outcomes), outcomes
    winner = outcomes.index("committed")
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        assert_trees_bit_equal(d.restore(url, like(trees[winner]), verify=True), trees[winner])
    arrays = {k.split("/")[1] for k in keys_under(url) if k.startswith("arrays/")}
    assert arrays == {b_arrays(url).rstrip("/")} and "WRITING" not in keys_under(url), keys_under(url)


# A process that saves step 1 through a manager, then is SIGKILLed while writing step 2.
KILLED_SAVE = """
import os, sys, time
import numpy as np
import dispatch_io as dio

root, ready = sys.argv[1], sys.argv[2]
tree = lambda seed: {"w": np.random.default_rng(seed).standard_normal((256, 256), dtype=np.float32), "n": seed}
with dio.LocalDispatcher(host_memory_budget=64 << 10) as d, dio.CheckpointManager(root, d) as manager:
    manager.save(1, tree(1)).wait()

    def stop(keypath):  # step 2 has written arrays: tell the parent, wait to be killed
        open(ready, "w").close()
        time.sleep(600)
    manager.save(2, tree(2), on_write_end=stop).wait()
"""


def test_a_killed_save_is_never_listed_and_the_next_manager_clears_it(store_prefix, tmp_path):
    """A real process SIGKILLed mid-save on an object store: its step is never listed, the
    previous one restores bit-exact, and the next manager removes the dead save's keys (its
    marker names a process that is gone) so the step can be saved again."""
    import numpy as np
    root, ready = f"{store_prefix}/run", tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, root, str(ready)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(1200):
            if ready.exists() or child.poll() is not None:
                break
            threading.Event().wait(0.1)
        assert ready.exists(), child.communicate(timeout=10)[0].decode()[-3000:]
        keys = keys_under(root)
        assert "2/WRITING" in keys and any(k.startswith("2/arrays/") for k in keys), keys
    finally:
        child.kill()
        child.wait(30)
    expected = {"w": np.random.default_rng(1).standard_normal((256, 256), dtype=np.float32), "n": 1}
    with dio.CheckpointManager(root) as manager:
        assert not any(k.startswith("2/") for k in keys_under(root)), keys_under(root)
        assert manager.all_steps() == [1]
        restored = manager.restore(1)
        assert restored["w"].tobytes() == expected["w"].tobytes() and restored["n"] == 1
        manager.save(2, {"w": expected["w"] + 1, "n": 2}).wait()
        assert manager.all_steps() == [1, 2]


def copy_keys(src_spec: dict, dst_spec: dict):
    src, dst = ts.KvStore.open(src_spec).result(), ts.KvStore.open(dst_spec).result()
    for key in src.list().result():
        dst.write(key, src.read(key).result().value).result()


@pytest.mark.parametrize("layout", ["ocdbt", "files"])
def test_copied_checkpoint_restores_both_ways(store_prefix, mesh, tmp_path, layout):
    """A checkpoint is self-contained: uploaded from disk to an object store, or downloaded, it restores."""
    tree = make_tree(mesh, 5)
    local, uploaded, downloaded = tmp_path / "ckpt", f"{store_prefix}/uploaded", tmp_path / "downloaded"
    with dio.LocalDispatcher(host_memory_budget=MiB, layout=layout, checksums=True) as d:
        d.save(local, tree).wait()
        copy_keys({"driver": "file", "path": f"{local}/"}, kvstore_spec(uploaded))
        assert_trees_bit_equal(d.restore(uploaded, like(tree), verify=True), tree)
        copy_keys(kvstore_spec(uploaded), {"driver": "file", "path": f"{downloaded}/"})
        assert_trees_bit_equal(d.restore(downloaded, like(tree), verify=True), tree)


def test_transient_503_and_429_are_retried(object_store, store_prefix, mesh, monkeypatch):
    """Throttling answers (503 SlowDown, 429) during save, listing and restore are retried with
    backoff (TensorStore's s3_request_retries / gcs_request_retries) and the checkpoint comes
    out whole. (Backoff shortened to keep the test fast: the count of retries is what matters.)"""
    import dispatch_io.storage.objectstore
    monkeypatch.setattr(dispatch_io.storage.objectstore, "OBJECT_STORE_RETRIES",
                        {"max_retries": 8, "initial_delay": "20ms", "max_delay": "100ms"})
    proxy = FaultyProxy(object_store.port)
    try:
        monkeypatch.setenv(object_store.endpoint_variable, proxy.endpoint)
        tree, root = make_tree(mesh, 9), f"{store_prefix}/run"
        with dio.LocalDispatcher(host_memory_budget=MiB) as d, dio.CheckpointManager(root, d) as manager:
            proxy.fail(2, 503, method=object_store.upload_method)
            proxy.fail(1, 429, method="GET")
            manager.save(1, tree).wait()
            assert manager.all_steps() == [1]
            proxy.fail(2, 503, method="GET")
            proxy.fail(1, 429)
            assert_trees_bit_equal(manager.restore(target=like(tree)), tree)
        statuses = sorted(status for _, _, status in proxy.failed)
        assert statuses == [429, 429, 503, 503, 503, 503], proxy.failed
        assert not proxy.to_fail and proxy.forwarded > 10
    finally:
        proxy.stop()


@pytest.mark.parametrize("dispatcher_cls", [dio.LocalDispatcher, dio.ColocatedDispatcher], ids=["local", "colocated"])
def test_no_object_is_written_twice_in_a_save(object_store, store_prefix, mesh, monkeypatch, dispatcher_cls):
    """GCS takes about one write per second to an object name: a save (many batches, each an
    OCDBT commit) must never rewrite an object -- numbered OCDBT manifests on object stores, and
    one commit at a time per database (slow manifests make racing commits overlap)."""
    proxy = FaultyProxy(object_store.port)
    proxy.slow("manifest.", 0.1)
    try:
        monkeypatch.setenv(object_store.endpoint_variable, proxy.endpoint)
        path = f"{store_prefix}/ckpt"
        tree = make_tree(mesh)
        with dispatcher_cls(host_memory_budget=64 << 10) as d:
            stats = d.save(path, tree).wait()
            puts = proxy.objects_written()
            assert stats.batches >= 5
            assert len(puts) == len(set(puts)), sorted(p for p in puts if puts.count(p) > 1)
            assert_trees_bit_equal(d.restore(path, like(tree)), tree)
    finally:
        proxy.stop()


def test_cli_reads_object_stores(store_prefix, mesh):
    path = f"{store_prefix}/ckpt"
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=MiB, checksums=True) as d:
        d.save(path, tree).wait()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    for args in (["inspect", path], ["verify", path]):
        proc = subprocess.run([sys.executable, "-m", "dispatch_io.cli", *args], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "['params']['w']" in subprocess.run([sys.executable, "-m", "dispatch_io.cli", "inspect", path], env=env,
                                               capture_output=True, text=True, timeout=120).stdout
    proc = subprocess.run([sys.executable, "-m", "dispatch_io.cli", "verify", f"{store_prefix}/missing"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "nothing stored" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_urls_map_to_kvstores(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9/")
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    retries = {"max_retries": 8, "initial_delay": "1s", "max_delay": "16s"}
    assert kvstore_spec("s3://bucket/a/b") == {"driver": "s3", "bucket": "bucket", "path": "a/b/",
                                               "endpoint": "http://127.0.0.1:9", "aws_region": "eu-west-1",
                                               "context": {"s3_request_retries": retries}}
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "key")
    assert kvstore_spec("s3://bucket/a/b")["aws_credentials"] == {"type": "environment"}
    assert kvstore_spec("gs://bucket/run/7") == {"driver": "gcs", "bucket": "bucket", "path": "run/7/",
                                                 "context": {"gcs_request_retries": retries}}
    assert kvstore_spec("memory://x/y")["driver"] == "memory"
    with pytest.raises(ValueError, match="unsupported checkpoint URL 'ftp://host/x/'"):
        dio.metadata("ftp://host/x")


def test_an_unreachable_store_fails_clearly_and_soon(monkeypatch, mesh):
    """No server at the endpoint: every entry point raises an error naming the path once the
    (bounded) retries are spent, instead of retrying for a quarter of an hour."""
    import dispatch_io.storage.objectstore
    from s3_server import free_port
    monkeypatch.setattr(dispatch_io.storage.objectstore, "OBJECT_STORE_RETRIES",
                        {"max_retries": 2, "initial_delay": "10ms", "max_delay": "20ms"})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    path = "s3://ckpts/nowhere/step_1"
    with pytest.raises(dio.CheckpointError, match="s3://ckpts/nowhere/step_1: could not read COMMITTED: .*retry attempts"):
        dio.metadata(path)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        with pytest.raises(dio.CheckpointError, match="s3://ckpts/nowhere/step_1: could not"):
            d.save(path, make_tree(mesh))
        with pytest.raises(dio.CheckpointError, match="s3://ckpts/nowhere/step_1: could not"):
            d.restore(path)


# ---- ownership: markers prove what is ours; two saves to one prefix never commit a mix ----------------

def memory_url(name: str) -> str:
    return f"memory://{name}-{uuid.uuid4().hex[:8]}/ckpt"


@pytest.mark.parametrize("where", ["memory", "s3", "gcs"])
def test_a_save_started_over_a_live_one_never_commits_a_mix(where, request, mesh):
    """A second save to a prefix while a first writes there (two dispatchers, a zombie job): on
    this host it is refused at once; whatever ends up committed restores bit-exactly."""
    url = memory_url("overlap") if where == "memory" else f"{request.getfixturevalue(where + '_prefix')}/ckpt"
    first, second = make_tree(mesh, 1), make_tree(mesh, 2)
    refused = []
    with dio.LocalDispatcher(host_memory_budget=MiB) as a, dio.LocalDispatcher(host_memory_budget=MiB) as b:
        def second_save(keypath):
            if not refused:
                with pytest.raises(FileExistsError, match="another save or delete of .* is in progress") as info:
                    b.save(url, second)
                refused.append(info.value)
        a.save(url, first, on_write_end=second_save).wait()
        assert refused
        assert_trees_bit_equal(a.restore(url, like(first)), first)


@pytest.mark.parametrize("layout", ["ocdbt", "files"])
def test_a_taken_over_save_commits_nothing_and_deletes_nothing(mesh, monkeypatch, layout):
    """When the other writer cannot be proven alive (another host), a save takes the prefix
    over. The first one goes on writing -- into its own arrays/<id>/, which nothing references --
    then finds its WRITING claim gone at commit: it fails and leaves the new checkpoint whole."""
    import dispatch_io.storage as storage
    url = memory_url("takeover")
    first, second = make_tree(mesh, 1), make_tree(mesh, 2)
    monkeypatch.setattr(storage.Marker, "alive", property(lambda marker: False))  # as if on another host
    errors = []
    with dio.LocalDispatcher(host_memory_budget=64 << 10, layout=layout, write_threads=1, small_leaf_bytes=0) as a, \
            dio.LocalDispatcher(host_memory_budget=MiB, layout=layout, checksums=True) as b:
        def second_save(keypath):
            if not errors:
                errors.append(None)
                b.save(url, second).wait()
        with pytest.raises(dio.CheckpointError, match="another save to .* started while this one was writing"):
            a.save(url, first, on_write_end=second_save).wait()
        assert_trees_bit_equal(b.restore(url, like(second), verify=True), second)


def test_a_save_that_lost_the_race_never_deletes_the_winner(mesh, monkeypatch):
    """A found the prefix empty, then B saved and committed before A wrote its claim: A writes
    only its own arrays, fails at commit, and its abort removes only what A wrote."""
    import dispatch_io.storage as storage
    url = memory_url("race")
    first, second = make_tree(mesh, 1), make_tree(mesh, 2)
    listed, go = threading.Event(), threading.Event()
    keys = storage.KvLocation._keys

    def slow_keys(self):
        out = keys(self)
        if threading.current_thread().name == "first":
            listed.set()
            go.wait(30)
        return out
    monkeypatch.setattr(storage.KvLocation, "_keys", slow_keys)
    outcome = []
    with dio.LocalDispatcher(host_memory_budget=MiB) as a, dio.LocalDispatcher(host_memory_budget=MiB) as b:
        def run_first():
            try:
                a.save(url, first).wait()
                outcome.append("committed")
            except dio.CheckpointError as exc:
                outcome.append(str(exc))
        thread = threading.Thread(target=run_first, name="first")
        thread.start()
        assert listed.wait(30)
        b.save(url, second).wait()
        go.set()
        thread.join(60)
        assert "another save committed" in outcome[0], outcome
        assert_trees_bit_equal(b.restore(url, like(second)), second)
        assert not any(k.startswith("arrays/") and not k.startswith(f"arrays/{b_arrays(url)}") for k in keys_under(url))


def b_arrays(url: str) -> str:
    """The arrays folder the committed manifest names (``arrays/<id>/`` on kvstores)."""
    return KvLocation(url).read_manifest()["arrays"][len("arrays/"):]


def test_our_own_failed_save_does_not_block_the_next(mesh):
    """A WRITING marker of this very process whose save is no longer running (its abort failed,
    say) is abandoned: the next save takes the prefix over instead of refusing forever."""
    url = memory_url("own")
    put(url, "WRITING", Marker.new().encode())
    put(url, "arrays/0123abcd/x", b"partial")
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(url, tree).wait()
        assert_trees_bit_equal(d.restore(url, like(tree)), tree)


def test_foreign_keys_are_never_deleted(mesh):
    tree = make_tree(mesh)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        look_alike = memory_url("lookalike")  # our key names, no marker of ours: not ours
        put(look_alike, "manifest.json", b'{"tool": "someone else"}')
        put(look_alike, "arrays/embeddings.npy", b"precious")
        with pytest.raises(FileExistsError, match="not part of a dispatch_io checkpoint"):
            d.save(look_alike, tree, overwrite=True)
        assert keys_under(look_alike) == {"manifest.json", "arrays/embeddings.npy"}

        mixed = memory_url("mixed")  # a committed checkpoint with someone's file beside it
        d.save(mixed, tree).wait()
        put(mixed, "datasets/train.tfrecord", b"precious")
        with pytest.raises(FileExistsError, match=r"datasets/train.tfrecord"):
            d.save(mixed, tree, overwrite=True)
        assert "datasets/train.tfrecord" in keys_under(mixed)
        assert_trees_bit_equal(d.restore(mixed, like(tree)), tree)

    root = memory_url("root")
    put(root, "7/manifest.json", b'{"foreign": true}')
    put(root, "8/arrays/readme.txt", b"foreign")
    put(root, "9/DELETING", Marker.new().encode())     # an unfinished delete of ours: finished on open
    put(root, "9/arrays/manifest.ocdbt", b"x")
    put(root, "9/notes.txt", b"someone's, left alone")
    dio.CheckpointManager(root).close()
    assert keys_under(root) == {"7/manifest.json", "8/arrays/readme.txt", "9/notes.txt"}


def test_a_failed_save_leaves_nothing_and_a_crashed_one_is_cleared_by_the_next(mesh):
    url = memory_url("crash")
    tree = make_tree(mesh)
    dead = json.dumps({"host": os.uname().nodename, "pid": 2 ** 22 + 1, "started": "1", "time": 0, "id": "x"}).encode()
    put(url, "WRITING", dead)                  # a save killed mid-way
    put(url, "arrays/p0/manifest.ocdbt", b"partial")
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        d.save(url, tree).wait()
        assert_trees_bit_equal(d.restore(url, like(tree)), tree)
        assert "WRITING" not in keys_under(url)


@pytest.mark.parametrize("where", ["memory", "s3", "gcs"])
def test_claims_and_commit_markers_are_conditional_writes(where, request):
    """Two saves that both found the prefix free: the second claim fails at once (a conditional
    write, not list-then-write), and so would a second COMMITTED."""
    from dispatch_io.storage import KvWrite
    url = memory_url("claim") if where == "memory" else f"{request.getfixturevalue(where + '_prefix')}/ckpt"
    location = KvLocation(url)
    first = KvWrite(location, location.open_kv())
    with pytest.raises(FileExistsError, match="claimed it first"):
        KvWrite(location, location.open_kv())
    assert first._write_if_absent("COMMITTED", b"x") and not first._write_if_absent("COMMITTED", b"y")
    assert location._get("COMMITTED") == b"x"
    first.abort()  # removes its claim, not a COMMITTED its commit did not write
    assert location._keys() == ["COMMITTED"]
