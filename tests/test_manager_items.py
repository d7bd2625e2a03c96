"""CheckpointManager items and step info: items per step, committed with it and checked (CRC-32C),
the same items on every process, step info (crafted or malformed info.json a checkpoint error, never
outside the checkpoint, read consistently while a step is overwritten), Orbax Composite roots (also
on object stores), ``inspect`` of a root.

Values are compared exactly (bytes for bytes, JSON for JSON); directory listings are exact.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import dispatch_io as dio
from dispatch_io.storage import sealed
from conftest import FakeClock, assert_trees_bit_equal
from dispatch_io import policies as P


TIMEOUT = 60


def tree(step):
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "step": step}


KILLED_SAVE = r"""
import os, sys, time, numpy as np
import dispatch_io as dio
root = sys.argv[1]
with dio.CheckpointManager(root) as mgr:
    mgr.save(1, {"w": np.ones(4)}, items={"data": dio.PerProcess(b"one")}).wait()
    def stall(keypath):
        print("WRITING", flush=True)
        time.sleep(600)
    mgr.save(2, {"w": np.zeros(1 << 16)}, items={"data": dio.PerProcess(b"two")}, on_write_end=stall)
    mgr.wait()
"""


def _orbax_composite_root(root, with_grain: bool):
    import orbax.checkpoint as ocp
    handlers = {"items": ocp.StandardCheckpointHandler(), "config": ocp.JsonCheckpointHandler()}
    args = {"items": ocp.args.StandardSave({"w": np.arange(6.0), "b": np.int32(3) + np.zeros(2, np.int32)}),
            "config": ocp.args.JsonSave({"lr": 0.1})}
    iterator = None
    if with_grain:
        import grain
        import grain.python as gp
        iterator = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
        next(iterator), next(iterator), next(iterator)
        handlers["iter"], args["iter"] = gp.PyGrainCheckpointHandler(), gp.PyGrainCheckpointSave(iterator)
    options = ocp.CheckpointManagerOptions(best_fn=lambda metrics: metrics["loss"], best_mode="min")
    mgr = ocp.CheckpointManager(str(root), item_names=tuple(handlers), item_handlers=handlers, options=options)
    mgr.save(7, args=ocp.args.Composite(**args), metrics={"loss": 0.25})
    mgr.wait_until_finished()
    mgr.close()
    return iterator


def flip_bit(path, offset: int):
    """Flip the lowest bit of the byte at ``offset`` of the file at ``path``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


JOB_TIMEOUT = 120


def small_tree(step):
    return {"w": np.arange(6, dtype=np.float32) + step}


def _edit_info(step_dir, **changes):
    path = step_dir / "info.json"
    info = sealed.loads(path.read_bytes())   # edited: written back unsealed, as by hand
    for key, value in changes.items():
        if key == "items":
            info["items"].update(value)
        else:
            info[key] = value
    path.write_text(json.dumps(info))


def _inf_commit_time(info):
    info["committed"] = float("inf")
    return json.dumps(info)


def _huge_commit_time(info):
    info["committed"] = 1e300
    return json.dumps(info)


def _huge_int_metric(info):
    info["metrics"] = {"loss": 10 ** 400}        # a JSON integer: Python reads it, float() cannot
    return json.dumps(info)


def _deeply_nested_metadata(info):
    text = json.dumps(info)
    return text[:-1] + ', "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"


UNTRUSTED_INFO = [_inf_commit_time, _huge_commit_time, _huge_int_metric, _deeply_nested_metadata]
UNTRUSTED_IDS = ["inf-time", "huge-time", "huge-int-metric", "deep-nesting"]


def _root_with_info(root, craft):
    with dio.CheckpointManager(root) as mgr:
        mgr.save(1, small_tree(1)).wait()
    path = root / "1" / "info.json"
    path.write_text(craft(sealed.loads(path.read_bytes())))


ITEMS_DIFFER_JOB = r"""
import sys
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
import dispatch_io as dio
process, port, root = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", 2, process)
sharding = NamedSharding(jax.make_mesh((2,), ("data",)), PartitionSpec("data"))
state = jax.make_array_from_callback((8,), sharding, lambda index: np.arange(8, dtype=np.float32)[index])
with dio.CheckpointManager(root, barrier_timeout=30) as mgr:
    # process 1's loader is not set up yet (or it forgot the item): only process 0 passes it
    items = {"data": dio.PerProcess(b"p0-state")} if process == 0 else {}
    try:
        mgr.save(1, state, items=items).wait()
        mgr.wait()
        print("SAVED", flush=True)
    except Exception as exc:
        print("SAVE FAILED", type(exc).__name__, flush=True)
    if 1 in mgr.all_steps():
        try:
            print("ITEM", mgr.item(1, "data"), flush=True)
        except Exception as exc:
            print("ITEM FAILED", type(exc).__name__, str(exc)[:200], flush=True)
jax.distributed.shutdown()
"""

def test_items_and_step_info_commit_with_the_step(tmp_path):
    clock = FakeClock()
    with dio.CheckpointManager(tmp_path, clock=clock) as mgr:
        state = b"\x00\xffiterator-state\n"
        mgr.save(10, tree(10), items={"data": dio.PerProcess(state), "config": dio.Json({"lr": 0.1, "layers": [1, 2]}),
                                      "json_state": dio.PerProcess({"next_index": 7})},
                 metrics={"eval_loss": np.float32(2.5), "acc": 1}, metadata={"git": "abc123"}).wait()
        clock.now += 5
        mgr.save(11, tree(11))          # no items: restores as before
        mgr.wait()
        assert mgr.item(10, "data") == state
        assert mgr.item(10, "config") == {"lr": 0.1, "layers": [1, 2]}
        assert mgr.item(10, "json_state") == {"next_index": 7}
        info = mgr.step_info(10)
        assert (info.step, info.started, info.committed) == (10, 1_000_000.0, 1_000_000.0)
        assert info.metrics == {"eval_loss": 2.5, "acc": 1.0} and info.metadata == {"git": "abc123"}
        assert dict(info.items) == {"data": "per_process", "config": "json", "json_state": "per_process"}
        assert info.processes == 1 and info.version == dio.__version__
        assert mgr.step_info().step == 11 and mgr.step_info(11).items == {}
        assert_trees_bit_equal(mgr.restore(10), tree(10))
        with pytest.raises(KeyError, match=r"step 11 at .* has no item 'data' \(it has: none\)"):
            mgr.item(11, "data")
        with pytest.raises(KeyError, match=r"has no item 'dat' \(it has: config, data, json_state\)"):
            mgr.item(10, "dat")
    # Read back by a new manager (nothing cached), and by plain dispatch_io tools.
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.item(10, "data") == state and mgr.step_info(10).metrics["eval_loss"] == 2.5
    with dio.LocalDispatcher() as dispatcher:
        assert_trees_bit_equal(dispatcher.restore(tmp_path / "10"), tree(10))


def test_a_per_process_item_restored_by_another_process_count_names_both(tmp_path):
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, tree(1), items={"data": dio.PerProcess(b"x"), "cfg": dio.Json(1)})
    info_path = tmp_path / "1" / "info.json"
    info = sealed.loads(info_path.read_bytes())   # edited: unsealed
    info["items"]["data"]["processes"] = info["processes"] = 4     # as a 4-process job would have written it
    info_path.write_text(json.dumps(info))
    with dio.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(dio.CheckpointError, match=r"item 'data' of .* was saved by 4 processes.*this job has 1"):
            mgr.item(1, "data")
        assert mgr.item(1, "cfg") == 1      # a Json item is the step's, whatever the count


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(items={"a/b": dio.Json(1)}), ValueError, r"item name 'a/b'"),
    (dict(items={"..": dio.Json(1)}), ValueError, r"item name '\.\.'"),
    (dict(items={"data": b"raw"}), TypeError, r"item 'data' must be dio.Json\(value\) or dio.PerProcess"),
    (dict(items={"data": dio.PerProcess(object())}), ValueError, r"item 'data': object is neither bytes nor a JSON"),
    (dict(items={"cfg": dio.Json(float("nan"))}), ValueError, r"item 'cfg'"),
    # keys equal as JSON strings: read back, one value would be lost (a "corrupt" item with checksums on)
    (dict(items={"cfg": dio.Json({1: "a", "1": "b"})}), ValueError, r"item 'cfg': .*does not read back as saved"),
    (dict(items={"data": dio.PerProcess([{True: 1, "true": 2}])}), ValueError, r"item 'data': .*does not read back"),
    (dict(metrics={"loss": "low"}), TypeError, r"metric 'loss' must be a real number"),
    (dict(metrics={"loss": np.ones(3)}), TypeError, r"metric 'loss'"),
    (dict(metadata={"when": object()}), ValueError, r"metadata must be a JSON value"),
])
def test_bad_items_metrics_or_metadata_fail_before_anything_is_written(tmp_path, kwargs, error, message):
    with dio.CheckpointManager(tmp_path / "root") as mgr:
        with pytest.raises(error, match=message):
            mgr.save(1, tree(1), **kwargs)
        assert mgr.all_steps() == [] and os.listdir(tmp_path / "root") == []


def test_a_step_killed_while_saving_with_items_is_absent(tmp_path):
    root = tmp_path / "root"
    child = subprocess.Popen([sys.executable, "-c", KILLED_SAVE, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT
        while child.stdout.readline().strip() != "WRITING":
            assert time.monotonic() < deadline and child.poll() is None
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    with dio.CheckpointManager(root) as mgr:       # opening removes the dead save's leftovers
        assert mgr.all_steps() == [1] and mgr.item(1, "data") == b"one"
    assert sorted(os.listdir(root)) == ["1"]


@pytest.mark.parametrize("with_grain", [False, True], ids=["json", "grain"])
def test_an_orbax_composite_root_restores_items_by_name(tmp_path, with_grain):
    iterator = _orbax_composite_root(tmp_path, with_grain)
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [7]
        restored = mgr.restore(7, item="items")
        assert_trees_bit_equal(restored, {"b": np.full(2, 3, np.int32), "w": np.arange(6.0)})
        assert_trees_bit_equal(mgr.restore(7), restored)                 # the only PyTree item
        assert mgr.item(7, "config") == {"lr": 0.1}
        info = mgr.step_info(7)
        assert info.metrics == {"loss": 0.25} and info.items["config"] == "json" and info.items["items"] == "pytree"
        with pytest.raises(KeyError, match=r"no PyTree item 'state' \(its PyTree items: items\)"):
            mgr.restore(7, item="state")
        with pytest.raises(KeyError, match=r"has no item 'nope'"):
            mgr.item(7, "nope")
        if with_grain:
            import grain
            state = mgr.item(7, "iter")
            resumed = iter(grain.MapDataset.range(40).batch(4).to_iter_dataset())
            resumed.set_state(json.loads(state))
            assert [list(next(resumed)) for _ in range(3)] == [list(next(iterator)) for _ in range(3)]
        mgr.save(8, tree(8))                       # new steps are ours, beside Orbax's
        mgr.wait()
        assert mgr.all_steps() == [7, 8] and mgr.step_info(8).processes == 1


def test_inspect_of_a_root_lists_each_steps_info(tmp_path, capsys):
    from dispatch_io import cli
    clock = FakeClock(1_764_000_000.0)
    with dio.CheckpointManager(tmp_path, clock=clock) as mgr:
        mgr.save(3, tree(3), items={"data": dio.PerProcess(b"s")}, metrics={"loss": 0.5}, metadata={"git": "x"}).wait()
        clock.now += 60
        mgr.save(4, tree(4)).wait()
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(s["step"], s["committed"], s["metrics"], s["items"], s["metadata"], s["processes"]) for s in shown] == [
        (3, 1_764_000_000.0, {"loss": 0.5}, {"data": "per_process"}, {"git": "x"}, 1),
        (4, 1_764_000_060.0, {}, {}, None, 1)]
    assert cli.main(["inspect", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    assert "2025-11-24 16:00:00" in table and "loss=0.5" in table and "data(per_process)" in table, table


def test_items_carry_crc32cs_and_a_flipped_byte_is_named(tmp_path):
    """With checksums on, every item file carries its value's CRC-32C: reading an item, the
    manager's restore(verify=True) and ``dispatch-io verify`` check them, and a flipped byte is a
    CorruptCheckpointError naming the step, the item and the process."""
    from dispatch_io import cli
    state = bytes(range(256)) * 4
    with dio.LocalDispatcher(checksums=True) as d, dio.CheckpointManager(tmp_path, d) as mgr:
        mgr.save(10, tree(10), items={"data": dio.PerProcess(state), "config": dio.Json({"lr": 0.1})}).wait()
        mgr.save(11, tree(11), items={"data": dio.PerProcess(state), "config": dio.Json({"lr": 0.1})}).wait()
        assert mgr.step_info(10).item_entries["data"] == {"kind": "per_process", "processes": 1, "crc32c": True}
        arrays = tmp_path / "10" / mgr.step_info(10).arrays
        stored = json.loads((arrays / "items/data/0.json").read_bytes())
        assert set(stored) == {"bytes", "crc32c"}
        assert cli.main(["verify", str(tmp_path / "10")]) == 0

        data = arrays / "items/data/0.json"
        payload = data.read_bytes().index(b'"bytes": "') + len(b'"bytes": "')
        offset = next(i for i in range(payload + 8, payload + 100) if chr(data.read_bytes()[i]) in "BCDEFGHIJKLMNOPQRSTUVWXY")
        flip_bit(data, offset)   # still base64 of 1 KiB, one value different
        message = r"item 'data' \(process 0's value\) of step 10 at .*10 does not match its CRC-32C"
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            mgr.item(10, "data")
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            mgr.restore(10, verify=True)
        assert_trees_bit_equal(mgr.restore(10), tree(10))   # the state itself is sound
        assert cli.main(["verify", str(tmp_path / "10")]) == 1

        config = tmp_path / "11" / mgr.step_info(11).arrays / "items/config/value.json"
        flip_bit(config, config.read_bytes().index(b"0.1") + 2)   # {"lr": 0.0}: valid JSON, wrong value
        with pytest.raises(dio.CorruptCheckpointError, match=r"item 'config' of step 11 at .* does not match its CRC"):
            mgr.item(11, "config")
        flip_bit(config, config.read_bytes().index(b"{"))        # no JSON at all
        with pytest.raises(dio.CorruptCheckpointError, match=r"item 'config' of step 11 .*\(malformed checkpoint\)"):
            mgr.restore(11, verify=True)

    with dio.CheckpointManager(tmp_path / "plain") as mgr:   # checksums off: no CRC-32C, nothing to check
        mgr.save(1, tree(1), items={"data": dio.PerProcess(state)}).wait()
        assert "crc32c" not in mgr.step_info(1).item_entries["data"]
        assert mgr.item(1, "data") == state


def test_every_verify_gives_one_answer_for_a_step_with_a_corrupt_item(tmp_path, capsys):
    """``Dispatcher.verify``, ``dispatch-io verify`` and the manager's ``restore(verify=True)`` make
    the one check of a step's item files (``storage.step_files.verify_items``): a sound step passes
    all three, and one flipped byte of an item file fails all three, each naming the item."""
    from dispatch_io import cli
    items = {"data": dio.PerProcess(bytes(range(256)) * 4), "config": dio.Json({"lr": 0.1})}
    with dio.LocalDispatcher(checksums=True) as d, dio.CheckpointManager(tmp_path, d) as mgr:
        mgr.save(5, tree(5), items=items).wait()
        mgr.save(6, tree(6), items=items).wait()
        sound, step = str(tmp_path / "5"), str(tmp_path / "6")
        assert d.verify(sound).items_checked == 2
        assert cli.main(["verify", sound]) == 0
        assert "2 item files checked" in capsys.readouterr().out
        assert_trees_bit_equal(mgr.restore(5, verify=True), tree(5))

        config = tmp_path / "6" / mgr.step_info(6).arrays / "items/config/value.json"
        flip_bit(config, config.read_bytes().index(b"0.1") + 2)   # {"lr": 0.0}: valid JSON, wrong value
        message = r"item 'config' of step 6 at .*6 does not match its CRC-32C"
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            d.verify(step)
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            mgr.restore(6, verify=True)
        assert cli.main(["verify", step]) == 1
        assert "NOT sound" in (err := capsys.readouterr().err) and "item 'config' of step 6" in err
        assert d.verify(sound).items_checked == 2   # the other step is untouched


def test_every_verify_checks_the_items_of_a_local_tier_step(tmp_path):
    """A local tier's step holds its process's item files: ``Dispatcher.verify`` and ``dispatch-io
    verify`` of its directory check them as the manager's ``restore(verify=True)`` does."""
    from dispatch_io import cli
    items = {"data": dio.PerProcess(b"iterator state"), "config": dio.Json({"lr": 0.1})}
    tier = dio.LocalTier(str(tmp_path / "local"), save_policy=P.EveryNSteps(1))
    with dio.LocalDispatcher(checksums=True) as d, \
            dio.CheckpointManager(tmp_path / "root", d, save_policy=P.EveryNSteps(100), local=tier) as mgr:
        mgr.save(1, tree(1), items=items).wait()
        mgr.wait()
        step = str(tmp_path / "local" / "1")
        assert d.verify(step).items_checked == 2 and cli.main(["verify", step]) == 0
        data = tmp_path / "local" / "1" / "arrays" / "items" / "data" / "0.json"
        flip_bit(data, data.read_bytes().index(b'"bytes": "') + len(b'"bytes": "') + 4)
        message = r"item 'data' \(process 0's value\) of step 1 at .*1 does not match its CRC-32C"
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            d.verify(step)
        with pytest.raises(dio.CorruptCheckpointError, match=message):
            mgr.restore(1, tree(0), verify=True)   # through the tiers: this process's local copy
        assert cli.main(["verify", step]) == 1


def test_items_on_an_object_store_root_commit_and_go_with_their_step(store_prefix):
    """On S3 and GCS (servers on loopback) the items live under the save's own arrays/<id>/ and
    info.json beside the manifest: both are written before COMMITTED and deleted with the step."""
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec
    s3_prefix = store_prefix
    with dio.CheckpointManager(s3_prefix, keep_policy=P.LatestN(1)) as mgr:
        mgr.save(1, tree(1), items={"data": dio.PerProcess(b"one"), "cfg": dio.Json([1])}, metrics={"loss": 1})
        mgr.save(2, tree(2), items={"data": dio.PerProcess(b"two")}).wait()
        mgr.wait()
        assert mgr.all_steps() == [2] and mgr.item(2, "data") == b"two"
        assert mgr.step_info(2).arrays.startswith("arrays/") and mgr.step_info(2).arrays != "arrays/"
        with pytest.raises(FileNotFoundError):
            mgr.step_info(1)
    keys = [k.decode() for k in ts.KvStore.open(kvstore_spec(s3_prefix + "/")).result().list().result()]
    assert not [k for k in keys if k.startswith("1/")], keys           # step 1, items and info, all gone
    assert "2/info.json" in keys and any(k.startswith("2/arrays/") and k.endswith("items/data/0.json") for k in keys)


def test_an_item_name_in_info_json_cannot_read_outside_the_checkpoint(tmp_path):
    root = tmp_path / "root"
    with dio.CheckpointManager(root) as mgr:
        mgr.save(2, small_tree(2), items={"data": dio.Json(1)}).wait()
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "value.json").write_text('{"json": "read from outside the step"}')
    name = "../../../../secret"                  # root/2/arrays/items/<name>/value.json -> tmp_path/secret
    _edit_info(root / "2", items={name: {"kind": "json"}})
    with dio.CheckpointManager(root) as mgr:
        with pytest.raises((dio.CheckpointError, KeyError)):
            mgr.item(2, name)


@pytest.mark.parametrize("craft", [_inf_commit_time, _huge_int_metric, _deeply_nested_metadata],
                         ids=["inf-time", "huge-int-metric", "deep-nesting"])
def test_crafted_step_info_is_a_checkpoint_error_not_a_library_error(tmp_path, craft):
    """step_info / best_step / the policies on a step whose info.json is out of range must
    raise CheckpointError (or ignore the bad value), never OverflowError / RecursionError
    (which also kill every later retention: EveryNSeconds.keep floors the commit time, BestN
    calls isfinite on the metric)."""
    _root_with_info(tmp_path, craft)
    with dio.CheckpointManager(tmp_path) as mgr:
        try:
            info = mgr.step_info(1)
            mgr.best_step("loss")
            record = P.StepRecord(1, info.committed, info.metrics)
            P.EveryNSeconds(60).keep([record], 0.0)
            P.BestN(1, "loss").keep([record], 0.0)
        except dio.CheckpointError:
            pass


@pytest.mark.parametrize("craft", UNTRUSTED_INFO, ids=UNTRUSTED_IDS)
def test_inspect_of_a_root_with_crafted_step_info_is_one_line_exit_2(tmp_path, craft):
    _root_with_info(tmp_path / "root", craft)
    out = subprocess.run([sys.executable, "-m", "dispatch_io.cli", "inspect", str(tmp_path / "root")],
                         capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert out.returncode in (0, 2) and "Traceback" not in out.stderr, (out.returncode, out.stderr[-600:])


def test_a_deeply_nested_item_file_is_a_checkpoint_error(tmp_path):
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, small_tree(1), items={"cfg": dio.Json(1)}).wait()
    (tmp_path / "1" / "arrays" / "items" / "cfg" / "value.json").write_text(
        '{"json": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with dio.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(dio.CheckpointError):
            mgr.item(1, "cfg")


def test_a_step_whose_processes_passed_different_items_is_never_committed_half_there(tmp_path):
    """Items commit "atomically together", and the step info is process 0's alone: when the processes pass
    different item names, no step is committed that lists a PerProcess item process 1 never wrote (which
    process 1 would find "listed but its file is missing (malformed checkpoint)" on resume): a step
    committed is one whose items every process reads."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", ITEMS_DIFFER_JOB, str(i), str(port), str(tmp_path / "root")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=JOB_TIMEOUT)[0])
    finally:
        for p in procs:
            p.kill()
    for out in outs:
        assert "ITEM FAILED" not in out, outs


def test_step_info_of_a_step_not_yet_committed_on_an_object_store_is_file_not_found(s3_prefix):
    """On an object store info.json is written just before COMMITTED (and is left behind by a save killed
    between the two, until a manager on that host cleans up). step_info of a step not committed (and
    maybe never to be) is FileNotFoundError: "a step has its info exactly when committed" (docs/format.md)
    holds for readers too."""
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec
    with dio.CheckpointManager(s3_prefix) as mgr:
        mgr.save(1, small_tree(1), metrics={"loss": 1.0}).wait()
        kv = ts.KvStore.open(kvstore_spec(s3_prefix + "/")).result()
        kv.write("2/info.json", kv.read("1/info.json").result().value).result()   # step 2 mid-commit
        assert mgr.all_steps() == [1]
        with pytest.raises(FileNotFoundError):
            mgr.step_info(2)


def test_an_orbax_steps_nan_metric_reads_as_none_and_inspect_json_stays_json(tmp_path, capsys):
    """StepInfo.metrics is documented "None where it was NaN": an Orbax step's NaN metric (Orbax's metrics
    item holds {"loss": NaN}) reads as None too, and ``dispatch-io inspect --json`` stays JSON (never a
    bare NaN, which jq and JSON.parse refuse)."""
    import orbax.checkpoint as ocp
    from dispatch_io import cli
    options = ocp.CheckpointManagerOptions(best_fn=lambda m: m["loss"], best_mode="min")
    orbax_mgr = ocp.CheckpointManager(str(tmp_path), options=options)
    orbax_mgr.save(7, args=ocp.args.StandardSave({"w": np.arange(3.0)}), metrics={"loss": float("nan")})
    orbax_mgr.wait_until_finished()
    orbax_mgr.close()
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.step_info(7).metrics == {"loss": None}
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0

    def strict(constant):
        raise ValueError(f"not JSON: {constant}")
    json.loads(capsys.readouterr().out, parse_constant=strict)


def test_step_info_read_while_an_overwrite_is_in_flight_is_not_kept_after_it_commits(tmp_path):
    """Reading a step's info while save(step, overwrite=True) is in flight (the loop, or retention of the
    previous save, which reads every step's info on its own thread) does not keep the *replaced* step's
    info once the overwrite commits: step_info then has the new metrics, so BestN / best_step and
    inspect-by-manager agree with the disk."""
    import threading
    with dio.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, small_tree(5), items={"data": dio.PerProcess(b"old")}, metrics={"loss": 1.0}).wait()
        release = threading.Event()
        handle = mgr.save(5, small_tree(6), items={"data": dio.PerProcess(b"new")}, metrics={"loss": 2.0},
                          overwrite=True, on_write_end=lambda keypath: release.wait(JOB_TIMEOUT))
        try:
            mgr.step_info(5)                   # while the overwrite is being written
        finally:
            release.set()
        handle.wait()
        mgr.wait()
        assert mgr.step_info(5).metrics == {"loss": 2.0}


def test_an_orbax_root_on_an_object_store_is_not_silently_empty(tmp_path, s3_prefix):
    """MaxText keeps its Orbax checkpoints on an object store (gs://). A manager on such a root given as
    an object-store URL lists its steps -- never no step at all (latest_step() None, a ported loop
    starting again from step 0). (tests/test_orbax_object_stores.py reads them.)"""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from dispatch_io.storage import kvstore_spec
    local = tmp_path / "orbax"
    orbax_mgr = ocp.CheckpointManager(str(local))
    orbax_mgr.save(7, args=ocp.args.StandardSave({"w": np.arange(6.0)}))
    orbax_mgr.wait_until_finished()
    orbax_mgr.close()
    kv = ts.KvStore.open(kvstore_spec(s3_prefix + "/")).result()
    for folder, _, names in os.walk(local):            # the same root, as gsutil cp -r would put it
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                kv.write(os.path.relpath(path, local), f.read()).result()
    with dio.CheckpointManager(s3_prefix) as mgr:
        assert mgr.all_steps() == [7] and mgr.latest_step() == 7
