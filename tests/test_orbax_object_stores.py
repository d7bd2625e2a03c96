"""Orbax checkpoints where JAX users keep them: on S3 and GCS (real servers on loopback, see
tests/test_object_store.py), read as on a local directory -- restore, metadata, inspect, verify,
convert and a CheckpointManager taking over an Orbax run.

The checkpoints are written by real Orbax into a local directory, then uploaded byte for byte
with each store's own client -- boto3 for moto's S3, the GCS JSON API's media upload (plain HTTP)
for the GCS server -- as ``gsutil cp -r`` would put them: Orbax's path layer (etils.epath) has
no way to reach a loopback emulator.
"""

import json
import os
import shutil
import urllib.parse
import urllib.request

import jax
import numpy as np
import pytest
import tensorstore as ts

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io import cli
from dispatch_io.storage import kvstore_spec
from test_orbax import VARIANTS, make_state, ocp, orbax_ckpts  # noqa: F401 - orbax_ckpts: a fixture

pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")
MiB = 1 << 20


def upload(local, url: str) -> list[str]:
    """Every file under the local directory ``local``, put under ``url`` byte for byte by the
    store's own client; the keys written (relative to ``url``), sorted."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    files = sorted(os.path.relpath(os.path.join(d, n), local) for d, _, names in os.walk(local) for n in names)
    if scheme == "s3":
        import boto3
        client = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL_S3"], region_name="us-east-1")
    for name in files:
        with open(os.path.join(local, name), "rb") as f:
            data = f.read()
        key = f"{prefix}/{name}"
        if scheme == "s3":
            client.put_object(Bucket=bucket, Key=key, Body=data)
        else:
            query = urllib.parse.urlencode({"uploadType": "media", "name": key})
            request = urllib.request.Request(f"{os.environ['TENSORSTORE_GCS_HTTP_URL']}/upload/storage/v1/b/{bucket}/o?"
                                             f"{query}", data=data, method="POST",
                                             headers={"Content-Type": "application/octet-stream"})
            urllib.request.urlopen(request, timeout=60).close()
    return files


def stored_keys(url: str) -> list[str]:
    return sorted(k.decode() for k in ts.KvStore.open(kvstore_spec(url)).result().list().result())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_an_orbax_item_on_an_object_store_reads_as_the_local_one(orbax_ckpts, variant, store_prefix, mesh):
    """OCDBT and per-array, zarr2 and zarr3: restore (with and without a target), metadata,
    verify and convert of the uploaded item give what the local one gives, bit for bit."""
    state, paths = orbax_ckpts
    url = f"{store_prefix}/{variant}"
    assert stored_keys(url) == []
    assert upload(paths[variant], url) == stored_keys(url)
    with dio.LocalDispatcher(host_memory_budget=MiB) as d:
        assert_trees_bit_equal(d.restore(url), d.restore(paths[variant]))
        target = dio.metadata(url)
        assert jax.tree.structure(target) == jax.tree.structure(dio.metadata(paths[variant]))
        assert_trees_bit_equal(d.restore(url, target)["params"], state["params"])
        d.verify(url)   # every stored byte read (Orbax saves no CRC-32Cs of ours)
        converted = f"{store_prefix}/{variant}-converted"
        d.convert(url, converted)
        assert_trees_bit_equal(d.restore(converted, target), d.restore(url, target))


def test_the_command_line_reads_an_orbax_item_on_an_object_store(orbax_ckpts, store_prefix, capsys):
    _, paths = orbax_ckpts
    url = f"{store_prefix}/item"
    upload(paths["ocdbt-zarr3"], url)
    assert cli.main(["inspect", url]) == 0
    shown = capsys.readouterr().out
    assert "written by Orbax" in shown and "['params']['w']" in shown
    assert cli.main(["verify", url]) == 0
    assert cli.main(["convert", url, f"{store_prefix}/converted", "--budget-mib", "1"]) == 0
    assert cli.main(["verify", f"{store_prefix}/converted"]) == 0


def _orbax_run(root, mesh, with_iterator: bool = True):
    """An Orbax CheckpointManager run as MaxText writes one: Composite steps 10 and 20 of a
    PyTree ``items``, a JSON ``config`` and (with Grain) the data iterator ``iter``; a killed
    save's temporary directory beside them. Returns (the states, the iterator after step 20)."""
    import grain
    import grain.python as gp
    handlers = {"items": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler(),
                "iter": gp.PyGrainCheckpointHandler()}
    iterator = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
    states = {}
    with ocp.CheckpointManager(str(root), item_names=tuple(handlers), item_handlers=handlers) as mgr:
        for step in (10, 20):
            next(iterator)
            states[step] = {"params": make_state(mesh)["params"], "step": np.int32(step)}
            mgr.save(step, args=ocp.args.Composite(items=ocp.args.StandardSave(states[step]),
                                                   config=ocp.args.JsonSave({"lr": 0.1, "step": step}),
                                                   iter=gp.PyGrainCheckpointSave(iterator)))
            mgr.wait_until_finished()
    shutil.copytree(root / "20", root / "30.orbax-checkpoint-tmp-99")   # as a killed save leaves one
    return states, iterator


def test_a_manager_takes_over_an_orbax_run_on_an_object_store(tmp_path, mesh, store_prefix):
    """MaxText's checkpoints where they live: a manager on the gs:// / s3:// root lists Orbax's
    steps (not the killed save's leftover), restores their items by name, reads the Grain
    iterator state and the JSON item, and saves its own steps beside them; retention never
    deletes Orbax's."""
    import grain
    local = tmp_path / "run"
    states, iterator = _orbax_run(local, mesh)
    root = f"{store_prefix}/run"
    upload(local, root)
    with dio.CheckpointManager(root, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [10, 20] and mgr.latest_step() == 20
        assert mgr.step_info(20).items == {"config": "json", "items": "pytree", "iter": "grain"}
        restored = mgr.restore(20, item="items")
        assert_trees_bit_equal(restored["params"], jax.tree.map(np.asarray, states[20]["params"]))
        assert mgr.item(20, "config") == {"lr": 0.1, "step": 20}
        resumed = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
        resumed.set_state(json.loads(mgr.item(20, "iter")))
        assert [list(next(resumed)) for _ in range(3)] == [list(next(iterator)) for _ in range(3)]
        with pytest.raises(FileExistsError):
            mgr.save(20, restored)                     # never over an Orbax step
        for step in (21, 22, 23):
            mgr.save(step, dict(restored, step=step)).wait()
        mgr.wait()
        assert mgr.all_steps() == [10, 20, 22, 23]   # 21 (ours) dropped; Orbax's kept
        assert mgr.restore(22)["step"] == 22
    keys = stored_keys(root)
    assert any(k.startswith("10/items/") for k in keys) and any(k.startswith("30.orbax-checkpoint-tmp-99/") for k in keys)


def test_untrusted_orbax_metadata_on_an_object_store_is_bounded(orbax_ckpts, object_store, store_prefix,
                                                                monkeypatch):
    """The same bounds as on a local directory: a description larger than the bound is refused
    before it is read whole (the server sends a byte of it, not all), an array name that would
    leave the checkpoint is refused naming its key path."""
    import dispatch_io.formats.orbax as orbax_lib
    from s3_server import FaultyProxy
    _, paths = orbax_ckpts
    url = f"{store_prefix}/big"
    upload(paths["ocdbt-zarr3"], url)
    kv = ts.KvStore.open(kvstore_spec(url)).result()
    size = len(kv.read("_METADATA").result().value)
    monkeypatch.setattr(orbax_lib, "MAX_MANIFEST_BYTES", size - 1)
    proxy = FaultyProxy(object_store.port)
    try:
        monkeypatch.setenv(object_store.endpoint_variable, proxy.endpoint)
        with pytest.raises(dio.CorruptCheckpointError, match=f"_METADATA is larger than {size - 1} bytes"):
            dio.metadata(url)
        sent = sum(n for path, n in proxy.bytes_by_path.items() if "_METADATA" in path)
        assert 0 < sent < size, proxy.bytes_by_path
    finally:
        proxy.stop()
    monkeypatch.undo()

    crafted = f"{store_prefix}/crafted"
    upload(paths["files-zarr3"], crafted)
    kv = ts.KvStore.open(kvstore_spec(crafted)).result()
    meta = json.loads(bytes(kv.read("_METADATA").result().value))
    entry = next(e for e in meta["tree_metadata"].values() if e["key_metadata"][-1]["key"] == "w")
    entry["key_metadata"][-1]["key"] = "../../escape"
    kv.write("_METADATA", json.dumps(meta).encode()).result()
    with pytest.raises(dio.CorruptCheckpointError, match=r"\['params'\]\['\.\./\.\./escape'\]"):
        dio.metadata(crafted)


class ReplacedAfterProbe:
    """A kvstore (the real one underneath) whose value at ``key`` is replaced by ``bigger`` right
    after the first read of the byte one past ``limit`` (a bounded read's probe) is answered."""

    def __init__(self, kv, key: str, limit: int, bigger: bytes):
        self.kv, self.key, self.limit, self.bigger, self.replaced = kv, key, limit, bigger, False

    def read(self, key, byte_range=None, **kwargs):
        future = self.kv.read(key, byte_range=byte_range, **kwargs)
        if key == self.key and byte_range == slice(self.limit, self.limit + 1) and not self.replaced:
            try:
                future.result()
            except ValueError:  # out of range: the value held no more than limit bytes
                pass
            self.kv.write(key, self.bigger).result()
            self.replaced = True
        return future

    def __getattr__(self, name):
        return getattr(self.kv, name)


@pytest.mark.parametrize("which", ["orbax", "ours"])
def test_a_file_replaced_by_a_larger_one_after_its_probe_is_refused(orbax_ckpts, s3_prefix, mesh, monkeypatch, which):
    """Orbax's _METADATA (a KvFolder) and our manifest.json (KvLocation.read_manifest): the probe
    one byte past the bound finds a small file, which is then replaced by a larger one (valid
    JSON still): the read refuses it by its length, naming the file and the bound."""
    import dispatch_io.formats.orbax as orbax_lib
    import dispatch_io.storage.objectstore as objectstore
    url = f"{s3_prefix}/{which}"
    if which == "orbax":
        upload(orbax_ckpts[1]["ocdbt-zarr3"], url)
        key, module = "_METADATA", orbax_lib
    else:
        with dio.LocalDispatcher() as d:
            d.save(url, {"w": np.arange(64, dtype=np.float32)}).wait()
        key, module = "manifest.json", objectstore
    original = bytes(ts.KvStore.open(kvstore_spec(url)).result().read(key).result().value)
    monkeypatch.setattr(module, "MAX_MANIFEST_BYTES", len(original))
    probed = []
    real_open = objectstore.KvLocation.open_kv

    def open_kv(location, sub=""):
        store = ReplacedAfterProbe(real_open(location, sub), key, len(original), original + b" " * 64)
        probed.append(store)
        return store

    monkeypatch.setattr(objectstore.KvLocation, "open_kv", open_kv)
    with pytest.raises(dio.CorruptCheckpointError, match=f"{key} is larger than {len(original)} bytes"):
        dio.metadata(url)
    assert any(store.replaced for store in probed)


def test_a_listing_with_more_keys_than_the_cap_is_refused(orbax_ckpts, s3_prefix, monkeypatch):
    """A prefix holding more keys than ``MAX_LISTED_KEYS`` is refused, naming the prefix and the
    cap; one holding exactly as many is read."""
    import dispatch_io.storage.folders as folders
    _, paths = orbax_ckpts
    url = f"{s3_prefix}/many"
    keys = upload(paths["ocdbt-zarr3"], url)
    monkeypatch.setattr(folders, "MAX_LISTED_KEYS", len(keys) - 1)
    with pytest.raises(dio.CheckpointError, match=f"{url}: {len(keys)} keys .* more than the {len(keys) - 1}"):
        dio.metadata(url)
    monkeypatch.setattr(folders, "MAX_LISTED_KEYS", len(keys))
    assert dio.metadata(url)
