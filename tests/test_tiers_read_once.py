"""A restore through the tiers reads each byte of a local copy once: its own regions are checked
against their CRC-32Cs in memory as they are read, and a bad region alone comes from the next source.

Bytes read are the process's ``rchar`` from /proc/self/io: every byte passed to read()/pread()
(page-cache hits too: what the restore asks of the files, not what the disk served -- ``read_bytes``
counts only the latter, 0 for a cached file)."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
import storage_helpers as sh
from dispatch_io import policies

SHAPE = (1024, 2048)                      # float32: 8 MiB, 8 regions of 1 MiB (mesh data=4, model=2)
TOTAL = SHAPE[0] * SHAPE[1] * 4
REGION = TOTAL // 8


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["rchar"])


def _restore(mgr, step, target):
    before = _rchar()
    restored = mgr.restore(step, target)
    return restored, _rchar() - before


def test_a_restore_through_the_tiers_reads_each_byte_once_and_a_bad_region_alone_from_the_root(tmp_path, mesh):
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct(SHAPE, np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(np.prod(SHAPE), dtype=np.float32).reshape(SHAPE) * 3 + step, sharding)}
    tier = dio.LocalTier(tmp_path / "local" / "{process}", save_policy=policies.EveryNSteps(2))
    d = dio.LocalDispatcher(small_leaf_bytes=0, checksums=True)
    with dio.CheckpointManager(tmp_path / "root", d, save_policy=policies.EveryNSteps(4), local=tier) as mgr:
        for step in range(5):
            if mgr.should_save(step):
                mgr.save(step, state(step))
        mgr.wait()
        expected = np.asarray(state(4)["w"]).tobytes()
        restored, read = _restore(mgr, 4, target)          # step 4: local and persistent; all from the local copy
        stats = mgr.last_tier_restore
        assert np.asarray(restored["w"]).tobytes() == expected
        assert (stats.bytes_read_local, stats.bytes_read_persistent) == (TOTAL, 0), stats
        assert 0.95 * TOTAL <= read <= 1.05 * TOTAL, read  # once, checksums checked (the lower bound: counted)
        # One flipped byte in the local copy of region 0: found as it is read, that region alone from the root,
        # verified there before it is read (a region bad in both is never restored unchecked): read twice
        sh.flip_byte(sh.chunks(tmp_path / "local" / "0" / "4", "['w']")[(0, 0)])
        restored, read = _restore(mgr, 4, target)
        stats = mgr.last_tier_restore
        assert np.asarray(restored["w"]).tobytes() == expected
        assert (stats.step, stats.persistent_regions) == (4, 1), stats
        assert (stats.bytes_read_local, stats.bytes_read_persistent) == (TOTAL, REGION), stats
        assert 0.95 * (TOTAL + 2 * REGION) <= read <= 1.05 * (TOTAL + 2 * REGION), read
    d.close()
