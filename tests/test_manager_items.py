"""CheckpointManager as a training job uses it: items per step, step info, save policies with an
injected clock, metric retention on disk, retention off the save path, Orbax Composite roots.

Values are compared exactly (bytes for bytes, JSON for JSON); directory listings are exact.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import dispatch_io as dio
from conftest import FakeClock, assert_trees_bit_equal
from dispatch_io import policies as P

TIMEOUT = 60


def tree(step):
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step, "step": step}


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
    info = json.loads(info_path.read_bytes())
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


def test_save_policy_decides_and_force_overrides(tmp_path):
    clock = FakeClock()
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10) | P.EveryNSeconds(60), clock=clock) as mgr:
        decided = []
        for step in range(1, 31):
            clock.now += 7                          # 7 s a step: time-based saves every 9 steps
            if mgr.should_save(step):
                decided.append(step)
                assert mgr.save(step, tree(step)) is not None
            else:
                assert mgr.save(step, tree(step)) is None     # the policy says no: skipped
        assert mgr.save(31, tree(31), force=True) is not None  # a forced final save
        mgr.wait()
        assert decided == [9, 10, 19, 20, 29, 30]
        assert mgr.all_steps() == decided + [31]


def test_initial_policy_saves_only_into_an_empty_root(tmp_path):
    with dio.CheckpointManager(tmp_path, save_policy=P.Initial()) as mgr:
        assert mgr.should_save(0) and not mgr.should_save(0) is False   # one answer per step
        mgr.save(0, tree(0))
        assert not mgr.should_save(1)
    with dio.CheckpointManager(tmp_path, save_policy=P.Initial()) as mgr:
        assert not mgr.should_save(5)                                    # step 0 is committed


def test_best_n_on_disk_keeps_the_best_and_the_latest(tmp_path):
    losses = {1: 3.0, 2: 1.0, 3: 2.0, 4: 0.5, 5: 4.0, 6: 5.0}
    with dio.CheckpointManager(tmp_path, keep_policy=P.BestN(2, "eval_loss")) as mgr:
        for step, loss in losses.items():
            mgr.save(step, tree(step), metrics={"eval_loss": loss})
        mgr.wait()
        assert mgr.all_steps() == [2, 4, 6]           # the two best, and the newest (the worst)
        assert mgr.best_step() == 4 and mgr.best_step("eval_loss", "max") == 6
    assert sorted(os.listdir(tmp_path)) == ["2", "4", "6"]


def test_retention_never_delays_a_save(tmp_path, monkeypatch):
    """Deleting old steps (slow on object stores) runs on its own thread: the next save starts at once."""
    release = threading.Event()
    with dio.CheckpointManager(tmp_path, keep_policy=P.LatestN(1)) as mgr:
        real_delete = mgr._root.delete
        deleting = threading.Event()

        def slow_delete(step):
            deleting.set()
            assert release.wait(TIMEOUT)
            real_delete(step)

        monkeypatch.setattr(mgr._root, "delete", slow_delete)
        mgr.save(1, tree(1)).wait()
        mgr.save(2, tree(2)).wait()                    # commits; retention of step 1 starts
        assert deleting.wait(TIMEOUT)
        handle = mgr.save(3, tree(3))                  # not held up by the stuck delete
        handle.wait(TIMEOUT)
        assert 3 in mgr.all_steps() and 1 in mgr.all_steps()
        release.set()
        mgr.wait()                                     # waits for the retention too
        assert mgr.all_steps() == [3]


def test_reached_preemption_is_false_without_a_signal_and_true_after_sigterm(tmp_path):
    previous = []
    old = signal.signal(signal.SIGTERM, lambda s, f: previous.append(s))
    try:
        with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(100) | P.Preemption()) as mgr:
            assert not mgr.reached_preemption(1) and not mgr.should_save(1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert mgr.reached_preemption(2) and mgr.should_save(2)
            assert previous == [signal.SIGTERM]        # the program's own handler still ran
        assert signal.getsignal(signal.SIGTERM) is not None and previous == [signal.SIGTERM]
        os.kill(os.getpid(), signal.SIGTERM)           # put back on close: the program's handler again
        assert previous == [signal.SIGTERM, signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, old)


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


def flip_bit(path, offset: int):
    """Flip the lowest bit of the byte at ``offset`` of the file at ``path``."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


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


def test_preemption_is_never_reached_and_never_an_error_without_a_service(tmp_path, monkeypatch):
    """Orbax #3406: jax.distributed running without its preemption service crashed the save
    policy. Here reached_preemption is False, and no SIGTERM handler is taken over."""
    from dispatch_io.manager import preemption
    monkeypatch.setattr(preemption, "_jax_sync_manager", lambda: (object(), None))
    before = signal.getsignal(signal.SIGTERM)
    with dio.CheckpointManager(tmp_path, save_policy=P.EveryNSteps(10) | P.Preemption()) as mgr:
        assert signal.getsignal(signal.SIGTERM) is before
        assert not mgr.reached_preemption(3) and not mgr.should_save(3) and mgr.should_save(10)


def test_a_manager_made_off_the_main_thread_works_without_a_sigterm_handler(tmp_path):
    before, seen = signal.getsignal(signal.SIGTERM), []

    def run():
        with dio.CheckpointManager(tmp_path) as mgr:
            seen.append((mgr.reached_preemption(1), signal.getsignal(signal.SIGTERM) is before))
            mgr.save(1, tree(1), items={"data": dio.Json(1)})

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(TIMEOUT)
    assert seen == [(False, True)]
    with dio.CheckpointManager(tmp_path) as mgr:
        assert mgr.item(1, "data") == 1
