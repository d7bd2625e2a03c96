"""Parity in the local tier, in a real 4-process x 2-device pure-FSDP job (tests/jobs/job_fsdp_replicas.py
with ``LocalTier(parity=2)``), killed for real, every restore compared byte for byte: each process
keeps its share and 1/k of a row of parity; a process's local directory wiped, the job resumes its
newest local step from the survivors' copies and parity with nothing read from the root; a flipped
byte in a parity row, or in a member's own region, sends only the rebuilt regions it feeds (and that
member's region) to the root; onto a mesh of one device per process, a region made of two rebuilt
ones is read from memory whole; with process ids permuted on a restart, parity rebuilds nothing (its
rows are of the savers' places in the ring) and the job resumes an older step, bit-exact."""

import contextlib
import json
import os
import re
import shutil

import storage_helpers as sh
from conftest import finish_job, start_job
from test_tier_multiprocess import train_fsdp

from dispatch_io.manager.tiers import parity_plan

PARITY = {"DIO_TEST_PARITY": "2"}
SHARE = (64 * 16 * 4 + 16 * 64 * 4 + 8 * 2 * 4) // 4    # w, m, k: a quarter on each process
B, S = 32 * 4, 8 * 4 * 4                                  # b (everywhere), s (process 0's alone)
ROWS = (8 + 512 + 64 + 512) * 2     # a process's rows: k, m, s, w each padded to its largest shard; 2 devices


def _run(root, local, mode, durability="local", extra=None):
    """Run job_fsdp_replicas.py with parity to its end (its restores requiring ``durability``): each
    process's (listing, step, exact, bytes local, persistent, received, regions from peers, from the root)."""
    outs = finish_job(start_job("job_fsdp_replicas.py", [root, local, mode],
                                extra={**PARITY, "DIO_TEST_DURABILITY": durability, **(extra or {})}))
    found = [(re.search(r"^steps (.*)$", out, re.M),
              re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+) rchar \d+$", out, re.M),
              re.search(r"^regions peer (\d+) persistent (\d+)$", out, re.M)) for out in outs]
    assert all(all(f) for f in found), outs
    return [(s[1], int(r[1]), r[2] == "True", int(r[3]), int(r[4]), int(r[5]), int(g[1]), int(g[2]))
            for s, r, g in found]


def _stored_bytes(path, keypaths):
    return sum(v.length for keypath in keypaths for v in sh.chunks(path, keypath).values())


def test_a_lost_process_is_rebuilt_from_its_peers_copies_and_parity(tmp_path):
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    train_fsdp(root, local, PARITY)
    info = [json.loads((tmp_path / "local" / str(p) / "8" / "info.json").read_text()) for p in range(4)]
    assert [(i["copies"], i["durability"]) for i in info] == [(1, "parity 2")] * 4, info
    section = info[1]["parity"]
    assert (section["k"], section["ring"]) == (2, [0, 2, 1, 3])     # domains (0, 0, 1, 1) interleaved
    assert sorted(section["layouts"]) == ["0", "1", "3"]   # itself and the 2 it covers (positions 3, 0)
    # Storage per process: its share, and its parity rows: W / k per device (W: its row, each leaf padded
    # to its largest shard) -- about half its share here, against a full copy with replicas=1.
    for p in range(4):
        step = tmp_path / "local" / str(p) / "8"
        own = _stored_bytes(step, ["['w']", "['m']", "['k']"])
        rows = _stored_bytes(step / "parity", [f"['g0d{i}']" for i in range(2)])
        assert own == SHARE and rows == parity_plan.storage(info[p]["parity"], 2) == ROWS // 2
        print(f"process {p}: share {own} B, parity {rows} B: {(own + rows) / own:.2f}x")
        assert 1.4 < (own + rows) / own < 1.6
    # Process 0 killed between step 8's commit and its parity rows': step 8 has one copy of some regions,
    # listed "local", and a restore requiring durability "replicated" resumes step 6.
    os.rename(tmp_path / "local" / "0" / "8" / "parity", tmp_path / "parity")
    results = _run(root, local, "resume", durability="replicated")
    assert all(r[0] == "{0: 'persisted', 2: 'parity 2', 4: 'parity 2', 6: 'persisted', 8: 'local'}" and
               r[1:3] == (6, True) for r in results), results
    os.rename(tmp_path / "parity", tmp_path / "local" / "0" / "8" / "parity")
    # Process 2's host is gone with its disk, and process 3 restarts as process 2 (ids permuted; a new host
    # is process 3): the copies are mapped by the regions they hold, but parity rows and layouts belong to
    # the place of the process that saved them in the ring -- process 3's rows are not process 2's, and the
    # XOR of the wrong rows is not process 3's regions. So parity rebuilds nothing: process 2's regions are
    # lost, and the job resumes step 6 bit-exact, those regions from the root.
    aside = tmp_path / "aside"
    os.rename(tmp_path / "local" / "2", aside)
    os.rename(tmp_path / "local" / "3", tmp_path / "local" / "2")
    results = _run(root, local, "resume")
    print("ids permuted, one host lost:", results)
    assert all(r[0] == "{0: 'persisted', 6: 'persisted'}" and r[1:3] == (6, True) for r in results), results
    shutil.rmtree(tmp_path / "local" / "3")
    os.rename(tmp_path / "local" / "2", tmp_path / "local" / "3")
    os.rename(aside, tmp_path / "local" / "2")
    # Process 1's host is gone with its disk: the job lists step 8 as whole (parity rebuilds 1's regions),
    # resumes it bit-exact, and reads nothing from the root.
    shutil.rmtree(str(local).replace("{process}", "1"))
    results = _run(root, local, "resume")
    print("per process (steps, step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[0] == "{0: 'persisted', 2: 'parity 2', 4: 'parity 2', 6: 'persisted', 8: 'parity 2'}"
               for r in results), results
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert results[1][3] == SHARE, results                            # 1: its share rebuilt (read from memory),
    # 1 receives its rows once (each piece finished by its holder: 2 for piece 0, 0 for piece 1, ring 0, 2, 1, 3)
    # and b from a peer; each holder first receives the piece its parity covers from the group's other member
    assert [r[5] for r in results] == [ROWS // 2, ROWS + B, ROWS // 2, 0], results
    assert [r[3] for r in results] == [SHARE + B + S, SHARE, SHARE + B, SHARE + B], results
    # Onto a mesh of each process's first device alone: each region of process 1's is its two rebuilt
    # regions (one per device) together, read from memory as one -- still nothing from the root.
    results = _run(root, local, "narrow")
    print("onto one device per process:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    # A promotion of step 8 reads the local copies alone (no rebuild): every process refuses it, naming the
    # process without a copy and what to do instead.
    procs = start_job("job_fsdp_replicas.py", [root, local, "promote"], extra=PARITY)
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode != 0 for p in procs), outs
    assert all(re.search(r"FileNotFoundError: .* process\(es\) \[1\] have no local copy of it \(lost\?\); a restore "
                         r"rebuilds a lost process's regions from parity, a promotion does not", err) for _, err in outs)
    # At step 6 (persisted too; step 8 gone), a flipped byte in process 2's parity row of device position 0:
    # process 2 covers piece 0 of process 1's rows (k's and m's bytes there), so process 1's k and m regions
    # of its first device come from the root; and one in process 3's own w region of its second device,
    # which feeds piece 0 of process 1's rows there (through process 2's group): k and m of process 1's
    # second device from the root too -- and that w region of process 3's (its own read fails its check).
    # The rest of process 1's share is rebuilt.
    for p in (0, 2, 3):
        shutil.rmtree(tmp_path / "local" / str(p) / "8")
    sh.flip_byte(sh.chunks(tmp_path / "local" / "2" / "6" / "parity", "['g0d0']")[(0, 0)])
    sh.flip_byte(sh.chunks(tmp_path / "local" / "3" / "6", "['w']")[(7, 0)])    # rows 56:64, process 3's device 7
    results = _run(root, local, "resume")
    print("per process (steps, step, exact, local, persistent, received, peer regions, persistent regions):", results)
    assert all(r[1:3] == (6, True) for r in results), results
    km = 2 * 4 + 16 * 8 * 4                                  # a device's k[i:i+1] and m[:, 8i:8i+8]
    assert [r[4] for r in results] == [0, 2 * km, 0, 8 * 16 * 4], results
    assert all(r[7] == 5 for r in results), results
    assert results[1][3] == SHARE - 2 * km, results


def test_a_rebuild_goes_row_group_by_row_group(tmp_path):
    """With rows of at most 512 bytes, the protected leaves are in several row groups (w, m, then k
    and s): each is rebuilt in turn (a feeder holds one group's rows at a time), bit-exact, nothing
    from the root."""
    small = {**PARITY, "DIO_TEST_ROW_BYTES": "512"}
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    train_fsdp(root, local, small)
    info = json.loads((tmp_path / "local" / "0" / "8" / "info.json").read_text())
    assert len(info["parity"]["groups"]) >= 3, info["parity"]["groups"]
    shutil.rmtree(str(local).replace("{process}", "2"))
    results = _run(root, local, "resume", extra=small)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert results[2][3] == SHARE, results     # 2: its share rebuilt, group by group, served from memory


def test_a_row_of_bytes_holds_every_dtype_and_gives_each_region_back_bit_exact():
    """One parity row of leaves of every kind -- bfloat16, bool, int8, int4 and uint4 (a byte each, the
    value's bits low, as numpy holds them), complex64, PRNG keys (their key data), a leaf on two of the
    8 devices -- packed on each device of a "process" of two devices (``packed_rows.row``, as ``parity.encode``
    packs them) and cut back (``rebuild._cut``, as a rebuilt process cuts its rows): every region's
    bytes and dtype as the shard's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dispatch_io.manager.tiers import parity, rebuild, packed_rows

    devices = sorted(jax.devices(), key=lambda d: d.id)
    mesh, pair = Mesh(np.array(devices), ("x",)), Mesh(np.array(devices[2:4]), ("x",))
    values = np.arange(-40, 56) * 37 % 251

    def leaf(shape, dtype, on=mesh):
        host = np.asarray(values[:int(np.prod(shape))].reshape(shape) % (2 if dtype == jnp.bool_ else 8)
                          if dtype in (jnp.bool_, jnp.int4, jnp.uint4) else values[:int(np.prod(shape))].reshape(shape))
        return jax.device_put(host.astype(dtype) - (4 if dtype == jnp.int4 else 0), NamedSharding(on, P("x")))

    tree = {"bf": leaf((16, 3), jnp.bfloat16), "bo": leaf((8, 5), jnp.bool_), "i8": leaf((24,), jnp.int8),
            "i4": leaf((16, 3), jnp.int4), "u4": leaf((8,), jnp.uint4), "c": leaf((8, 2), jnp.complex64),
            "pair": leaf((4, 3), jnp.float32, pair),
            "key": jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(mesh, P("x")))}
    group = [packed_rows.leaf(f"['{name}']", array) for name, array in tree.items()]
    by_process = {p: devices[2 * p:2 * p + 2] for p in range(4)}
    section = parity.record([group], (0, 1, 2, 3), 2, by_process)
    width = section["groups"][0]["W"]
    shards = [{s.device: s.data for s in item.data.addressable_shards} for item in group]
    data = np.concatenate([np.asarray(packed_rows.row(group, d, shards, by_bytes=True,
                                               pad=width - sum(item.nbytes for item in group)))[0] for d in by_process[1]])
    regions, failed = rebuild._cut(data, rebuild._Rows(2, section["groups"], 2), 1, section["layouts"]["1"], [])
    assert not failed
    checked = 0
    for name, array in tree.items():
        stored = jax.random.key_data(array) if name == "key" else array
        for shard in stored.addressable_shards:
            if shard.device in by_process[1]:
                bounds = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(shard.index, stored.shape))
                got, want = regions[f"['{name}']"][bounds], np.asarray(shard.data)
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (name, bounds, got, want)
                checked += 1
    assert checked == 2 * len(tree)


def test_a_members_regions_stored_in_one_chunk_are_read_for_a_rebuild_checked_whole(tmp_path):
    """A process holding both device regions of a small leaf saves them as one stored chunk (its
    CRC-32C is of the whole chunk): each region read to rebuild a lost process (``rebuild_reads.Source.read``)
    is checked with its whole chunks and cut from them, bit-exact -- it was refused as corrupt, so the
    groups it fed fell back to the root or an older step. A flipped byte still refuses both."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import dispatch_io as dio
    from dispatch_io.manager.tiers import rebuild_reads

    devices = sorted(jax.devices(), key=lambda d: d.id)
    host = np.arange(32, dtype=np.float32).reshape(8, 4)
    s = jax.device_put(host, NamedSharding(Mesh(np.array(devices[:2]), ("x",)), P("x")))
    wanted = [("['s']", ((0, 4), (0, 4))), ("['s']", ((4, 8), (0, 4)))]
    with dio.LocalDispatcher(checksums=True) as d:
        d.save(str(tmp_path / "8"), {"s": s}, own=True).wait()
        assert list(sh.chunks(tmp_path / "8", "['s']")) == [(0, 0)]      # one chunk: both regions
        with contextlib.closing(rebuild_reads.Source(str(tmp_path / "8"), d.runner)) as source:
            read = source.read(wanted)
        assert [read[w].tobytes() for w in wanted] == [host[:4].tobytes(), host[4:].tobytes()]
        sh.flip_byte(sh.chunks(tmp_path / "8", "['s']")[(0, 0)])
        with contextlib.closing(rebuild_reads.Source(str(tmp_path / "8"), d.runner)) as source:
            assert source.read(wanted) == dict.fromkeys(wanted)
