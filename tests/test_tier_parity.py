"""Parity in the local tier, in a real 4-process x 2-device pure-FSDP job (tests/jobs/job_fsdp_replicas.py
with ``LocalTier(parity=2)``), killed for real, every restore compared byte for byte: each process
keeps its share and 1/k of a row of parity; a process's local directory wiped, the job resumes its
newest local step from the survivors' copies and parity with nothing read from the root; a flipped
byte in a parity row, or in a member's own region, sends only the rebuilt regions it feeds (and that
member's region) to the root; onto a mesh of one device per process, a region made of two rebuilt
ones is read from memory whole; with process ids permuted on a restart, parity rebuilds nothing (its
rows are of the savers' places in the ring) and the job resumes an older step, bit-exact."""

import contextlib
import dataclasses
import json
import os
import re
import shutil

import pytest

import storage_helpers as sh
from conftest import finish_job, start_job
from test_tier_multiprocess import train_fsdp

from dispatch_io.manager.tiers import parity_plan

PARITY = {"DIO_TEST_PARITY": "2"}
SHARE = (64 * 16 * 4 + 16 * 64 * 4 + 8 * 2 * 4) // 4    # w, m, k: a quarter on each process
B, S = 32 * 4, 8 * 4 * 4                                  # b (everywhere), s (process 0's alone)
ROWS = (8 + 512 + 64 + 512) * 2     # a process's rows: k, m, s, w each padded to its largest shard; 2 devices


def _trained_then_lost(tmp_path, lost: int):
    """(root, local template) of the parity job trained to step 8 (``train_fsdp``), then process ``lost``'s
    local directory wiped (its disk gone)."""
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    train_fsdp(root, local, PARITY)
    shutil.rmtree(str(local).replace("{process}", str(lost)))
    return root, local


def _run(root, local, mode, durability="local", extra=None, barrier_timeout=None):
    """Run job_fsdp_replicas.py with parity to its end (its restores requiring ``durability``): each
    process's (listing, step, exact, bytes local, persistent, received, regions from peers, from the root)."""
    outs = finish_job(start_job("job_fsdp_replicas.py", [root, local, mode], barrier_timeout=barrier_timeout,
                                extra={**PARITY, "DIO_TEST_DURABILITY": durability, **(extra or {})}))
    found = [(re.search(r"^steps (.*)$", out, re.M),
              re.search(r"^resumed (\d+) exact (\w+) local (\d+) persistent (\d+) received (\d+) rchar \d+$", out, re.M),
              re.search(r"^regions peer (\d+) persistent (\d+)$", out, re.M)) for out in outs]
    assert all(all(f) for f in found), outs
    return [(s[1], int(r[1]), r[2] == "True", int(r[3]), int(r[4]), int(r[5]), int(g[1]), int(g[2]))
            for s, r, g in found]


def _stored_bytes(path, keypaths):
    return sum(v.length for keypath in keypaths for v in sh.chunks(path, keypath).values())


def test_a_lost_process_is_rebuilt_from_its_peers_copies_and_parity(tmp_path, capsys):
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
    # A verify of one process's local step checks its parity rows too (they rebuild a lost peer's share):
    # one flipped byte in a row is NOT sound, named, by the CLI and Dispatcher.verify alike.
    from dispatch_io import cli
    step = str(tmp_path / "local" / "2" / "8")
    assert cli.main(["verify", step]) == 0
    row = next(iter(sh.chunks(os.path.join(step, "parity"), "['g0d1']").values()))
    sh.flip_byte(row)
    assert cli.main(["verify", step]) == 1
    assert "NOT sound" in (err := capsys.readouterr().err) and "['g0d1']" in err, err
    sh.flip_byte(row)   # back as saved
    assert cli.main(["verify", step]) == 0
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
    # 1 receives its rows once and b from a peer: ring 0, 2, 1, 3, each piece along its chain -- piece 0 from
    # its holder 2 to the group's other member 3, which XORs its piece in and sends it to 1; piece 1 from 0 to 2 to 1
    assert [r[5] for r in results] == [0, ROWS + B, ROWS // 2, ROWS // 2], results
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
    packs them) and cut back (``rebuild._cut``, as a rebuilt process cuts its rows, as its pieces came:
    across the pieces too): every region's
    bytes and dtype as the shard's."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dispatch_io.manager.tiers import packed_rows, parity, parity_plan, rebuild, rebuild_rounds

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
    rows = [np.asarray(packed_rows.row(group, d, shards, by_bytes=True,
                                       pad=width - sum(item.nbytes for item in group)))[0] for d in by_process[1]]
    piece = width // 2   # the rows as they come in: piece j of every device position's row, in turn
    data = {j: np.concatenate([row[j * piece:(j + 1) * piece] for row in rows]) for j in range(2)}
    regions, failed = rebuild._cut(data, rebuild_rounds.Rows(2, section["groups"], 2), 1, section["layouts"]["1"], [])
    assert not failed
    across = [kp for i in range(2) for kp, _, offset, nbytes in parity_plan.spans(section["groups"][0], section["layouts"]["1"][0][i])
              if len(parity_plan.touched(offset, nbytes, piece, 2)) == 2]
    assert across, "no region across the two pieces: the copy is not tried"
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


def _simulated_rebuild(monkeypatch, n, k, lost, tree, *, bad_rows=(), unreadable=(), absent=(), failing=(),
                       timeout=30, raising=(), row_bytes=1 << 30, breaking=()):
    """``rebuild.run`` in ``n`` threads standing for ``n`` single-device processes (ring 0..n-1, rows
    of ``k`` pieces, row groups of at most ``row_bytes``) of which ``lost`` have lost their copies: the
    rows the job saved (``packed_rows``,
    as ``parity.encode`` packs them), each process's own parity section (``parity.record``), its parity
    rows XORed from them, its regions as the restore's local pass read them (``have``; none for the
    ``unreadable`` (process, key path) and the copy it falls back to is not there), and a room on an
    in-memory coordination service; the parity rows of the ``bad_rows`` processes fail their CRC-32C
    check (as ``rebuild._parity_rows`` finds). Only the collectives (``rebuild_rounds.senders``', a mailbox per round here:
    what comes in is read-only, as ``np.asarray`` of the real one's result) and the manifest's
    sharing are stood in for. The ``absent`` processes never come (the room waits ``timeout`` s), the
    reads of the ``failing`` ones' parity rows raise OSError, the ``raising`` ones' own regions (``have``,
    packed before the ready barrier) raise OSError, the ``breaking`` ones fail making their parity rows'
    row inside the rounds (a RuntimeError): then it returns what each process that came raised. Else ({lost process: its rebuilt regions}, {lost process: its
    regions left out}, {process: bytes received})."""
    import concurrent.futures
    import threading

    import jax
    import numpy as np

    from dispatch_io.manager.tiers import packed_rows, parity, rebuild, rebuild_rounds
    from dispatch_io.multihost.coordination import Room
    from test_coordination import MemoryService

    devices = sorted(jax.devices(), key=lambda d: d.id)[:n]
    order, by_process = tuple(range(n)), {p: [devices[p]] for p in range(n)}
    leaves = [packed_rows.leaf(f"['{name}']", array) for name, array in tree.items()]
    groups = packed_rows.groups(leaves, row_bytes, by_dtype=False)
    sections = {}
    for p in range(n):   # each process records its own section
        with monkeypatch.context() as patch:
            patch.setattr(parity.jax, "process_index", lambda p=p: p)
            sections[p] = parity.record(groups, order, k, by_process)
    parity_rows = {}   # {row group: {holder: its parity row}}
    for g, group in enumerate(groups):
        W = sections[0]["groups"][g]["W"]
        shards = [{s.device: s.data for s in item.data.addressable_shards} for item in group]
        rows = {p: np.asarray(packed_rows.row(group, devices[p], shards, by_bytes=True,
                                              pad=W - sum(item.nbytes for item in group)))[0] for p in range(n)}
        width = W // k
        parity_rows[g] = {h: np.bitwise_xor.reduce([rows[m][j * width:(j + 1) * width] for j, m in enumerate(covered)])
                          for h, covered in parity_plan.members(order, k).items()}
    regions = {p: {} for p in range(n)}   # {process: {(key path, stored bounds): its region}}
    for item in leaves:
        for shard in item.data.addressable_shards:
            bounds = tuple((s.start or 0, m if s.stop is None else s.stop) for s, m in zip(shard.index, item.data.shape))
            regions[devices.index(shard.device)][(item.keypath, bounds)] = np.asarray(shard.data)

    me, wire = threading.local(), {"box": {}, "cond": threading.Condition()}

    def send(row, moves):
        assert not absent and not failing, "a collective entered without every process ready"
        calls = me.calls
        calls[moves] = calls.get(moves, -1) + 1
        out = next((m for m in moves if m[0] == me.p), None)
        into = next((m for m in moves if m[1] == me.p), None)
        with wire["cond"]:
            if out is not None:
                wire["box"][(moves, calls[moves], me.p)] = np.array(row)
                wire["cond"].notify_all()
            if into is None:
                return np.zeros_like(row)
            key = (moves, calls[moves], into[0])
            assert wire["cond"].wait_for(lambda: key in wire["box"], 60), key
            got = wire["box"].pop(key)
            got.flags.writeable = False   # as the real send gives it
            return got

    def parity_read(source, rows_):
        p = int(source.path.split(os.sep)[-3])
        if p in failing:
            raise OSError(f"process {p}'s disk went away")
        return ({}, {0}) if p in bad_rows else ({0: parity_rows[rows_.first][p].copy()}, set())

    @dataclasses.dataclass(frozen=True)
    class Described:
        leaves: tuple = ()

    monkeypatch.setattr(rebuild_rounds, "senders", lambda rounds, size: [lambda row, m=m: send(row, m) for m in rounds])
    rows_in = rebuild_rounds._parity_rows_in

    def parity_rows_in(held, row, width):
        if me.p in breaking:
            raise RuntimeError(f"process {me.p} broke making its row")
        return rows_in(held, row, width)
    monkeypatch.setattr(rebuild_rounds, "_parity_rows_in", parity_rows_in)
    monkeypatch.setattr(rebuild, "_parity_rows", parity_read)
    monkeypatch.setattr(rebuild.job_steps, "share_manifest", lambda *args: None)
    monkeypatch.setattr(rebuild, "parse_manifest", lambda doc, path: Described())
    class Service(MemoryService):   # with the barriers a gather ends with
        def wait_at_barrier(self, name, timeout_in_ms):
            with self.cond:
                self.values[name] = str(int(self.values.get(name, "0")) + 1)
                self.cond.notify_all()
                if not self.cond.wait_for(lambda: int(self.values[name]) % n == 0, timeout_in_ms / 1000):
                    raise RuntimeError(f"DEADLINE_EXCEEDED: {name}")

    service = Service()
    having = [p for p in range(n) if p not in lost]

    def process(p):
        me.p, me.calls = p, {}
        room = Room(service, p, n, timeout, "restore", "simulated", "the simulated restore")
        def have(kp, bounds):
            if p in raising:
                raise OSError(f"process {p}'s disk went away")
            return None if (p, kp) in unreadable else regions[p].get((kp, bounds))
        return rebuild.run(8, dict.fromkeys(lost), {q: sections[q] for q in having}, having, room,
                           lambda described: (None, []), process=p, step_path=f"/nonexistent/{p}/8",
                           runner=None, have=have)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        futures = {p: pool.submit(process, p) for p in range(n) if p not in absent}
        if absent or failing or raising or breaking:
            return {p: f.exception(timeout=120) for p, f in futures.items()}
        results = [futures[p].result(timeout=120) for p in range(n)]
    rebuilt = {p: results[p][0].regions for p in lost}
    for p in lost:
        for (kp, bounds), want in regions[p].items():
            got = rebuilt[p].get(kp, {}).get(bounds)
            if got is not None:   # what came back comes back bit for bit, in its dtype
                assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (p, kp, bounds)
    return rebuilt, {p: results[p][1] for p in lost}, {p: results[p][2] for p in range(n)}


def _mixed_tree(n):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)[:n]), ("x",))
    on = NamedSharding(mesh, P("x"))
    values = np.arange(-700, 700) * 37 % 251
    return {"bf": jax.device_put(values[:n * 6].reshape(n * 2, 3).astype(jnp.bfloat16), on),
            "f8": jax.device_put((values[:n * 5] / 7).astype(jnp.float8_e4m3fn), on),
            "f": jax.device_put(values[:n * 3].astype(np.float32) / 3, on),
            "key": jax.device_put(jax.random.split(jax.random.key(3), n), on)}


def test_a_rebuild_with_three_pieces_brings_back_two_lost_processes_of_different_groups(monkeypatch):
    """k = 3 over 8 processes, processes 1 and 5 lost (no group holds both): each holder XORs two
    members' pieces into its parity row (``into_holder``, k > 2) and every lost region -- bfloat16,
    float8, float32, PRNG key data -- comes back bit for bit, each lost process receiving its row once."""
    rebuilt, failed, received = _simulated_rebuild(monkeypatch, 8, 3, (1, 5), _mixed_tree(8))
    assert failed == {1: {}, 5: {}}
    assert all(len(rebuilt[p][kp]) == 1 for p in (1, 5) for kp in ("['bf']", "['f8']", "['f']", "['key']")), rebuilt
    holders = {h for p in (1, 5) for _, h, _ in parity_plan.sources(tuple(range(8)), 3, p)}
    assert holders == {0, 7, 6, 4, 3, 2}
    assert received[1] == received[5] == max(received.values()) and received[1] > 0, received


def test_a_bad_parity_row_or_member_region_loses_only_the_lost_regions_it_feeds(monkeypatch):
    """k = 3 over 8, 1 and 5 lost; the row (39 bytes, pieces of 13): bf [0, 12), f8 [12, 17), f [17, 29),
    key [29, 37). The parity row of process 0 (process 1's piece 0) failing its check loses
    process 1's bf and f8 (each with a byte in piece 0); process 6's key region, not in memory and its copy
    gone, loses its piece 2, which feeds process 5's piece 1 (through holder 3): 5's f8 and f. Process 6's
    bf, in its piece 0 (covered by 5's parity, not used), loses nothing. The rest comes back bit for bit."""
    rebuilt, failed, _ = _simulated_rebuild(monkeypatch, 8, 3, (1, 5), _mixed_tree(8), bad_rows={0},
                                            unreadable={(6, "['bf']"), (6, "['key']")})
    assert failed == {1: {"['bf']": [[[2, 4], [0, 3]]], "['f8']": [[[5, 10]]]},
                      5: {"['f8']": [[[25, 30]]], "['f']": [[[15, 18]]]}}, failed
    assert sorted(rebuilt[1]) == ["['f']", "['key']"] and sorted(rebuilt[5]) == ["['bf']", "['key']"], rebuilt


def test_a_process_missing_when_the_rebuild_starts_is_named_before_any_collective(monkeypatch):
    """Process 3 (a member of process 1's groups) never comes to the rebuild: every other process
    raises BarrierTimeoutError naming it at ``rebuild-ready/<step>/<row group>``, within the timeout, without
    entering a round's collective (where it would wait for 3 for ever)."""
    from dispatch_io.errors import BarrierTimeoutError

    raised = _simulated_rebuild(monkeypatch, 4, 2, (1,), _mixed_tree(4), absent=(3,), timeout=2)
    assert sorted(raised) == [0, 1, 2]
    for p, exc in raised.items():
        assert isinstance(exc, BarrierTimeoutError) and exc.processes == [3], (p, exc)
        assert "rebuild-ready/8/0" in str(exc) or "rebuild-ready/8/0" in exc.barrier, (p, exc)


@pytest.mark.parametrize("row_bytes", [1 << 30, 16])
def test_a_process_failing_inside_the_rounds_takes_its_part_and_fails_the_rebuild_everywhere(monkeypatch, row_bytes):
    """Process 0 (a holder) fails making its parity rows' row inside the rounds: it still takes its part in
    every round's collective (its idle row: its partners wait there), then raises its error, and every
    other process a CheckpointError naming it -- after the last round, or at the next row group's
    barrier (rows of 16 bytes: several groups) -- rather than leaving its partner in a collective."""
    from dispatch_io.errors import CheckpointError

    raised = _simulated_rebuild(monkeypatch, 4, 2, (1,), _mixed_tree(4), breaking=(0,), row_bytes=row_bytes)
    assert sorted(raised) == [0, 1, 2, 3]
    assert isinstance(raised[0], RuntimeError) and "process 0 broke" in str(raised[0]), raised
    for p in (1, 2, 3):
        assert isinstance(raised[p], CheckpointError) and str(raised[p]).startswith("process 0 ") and \
            "RuntimeError: process 0 broke making its row" in str(raised[p]), raised


def test_a_process_that_cannot_take_its_part_fails_the_rebuild_everywhere_before_any_collective(monkeypatch):
    """Process 3 (a holder of process 1's piece 1) cannot read its parity rows (an OSError, not a bad
    row): it raises that, and every other process raises a CheckpointError naming process 3 -- no one
    enters a round's collective (where the others would wait for 3 for ever)."""
    from dispatch_io.errors import CheckpointError

    raised = _simulated_rebuild(monkeypatch, 4, 2, (1,), _mixed_tree(4), failing=(3,), timeout=10)
    assert isinstance(raised[3], OSError), raised
    for p in (0, 1, 2):
        assert isinstance(raised[p], CheckpointError) and "process 3" in str(raised[p]), (p, raised[p])
        assert "disk went away" in str(raised[p]), raised[p]


def test_a_rebuild_takes_from_memory_only_regions_held_as_stored():
    """``Fill.in_memory`` (a member's ``have`` in a rebuild beside the local pass) hands over a region's
    host buffer as it landed (``Landed``) only as stored: not one read as another dtype (``cast=True``:
    float32 read as bfloat16, or as int32, the same size), not a region whose read failed its check,
    not one it does not hold whole in one buffer (another mesh's region: the wait ends with the pass);
    a PRNG key's data (stored bounds with the key's dimension) is handed over as it is."""
    import numpy as np

    from dispatch_io import tree
    from dispatch_io.manager.tiers.tier_fill import Fill, Landed
    from dispatch_io.manifest import SavedLeaf
    from dispatch_io.read.targets import DEVICE, Output
    from dispatch_io.workers import ArraySpec

    def output(name, shape, stored_dtype, dtype, kind=tree.ARRAY, trail=()):
        stored = ArraySpec(name, tuple(shape) + trail, stored_dtype, tuple(shape) + trail)
        return Output(SavedLeaf(f"['{name}']", kind, "jax", tuple(shape), np.dtype(stored_dtype), stored=stored),
                      DEVICE, np.dtype(dtype))

    same, bf, i32 = output("f", (8, 4), "float32", "float32"), output("b", (8, 4), "float32", "bfloat16"), \
        output("i", (8, 4), "float32", "int32")
    key = output("k", (8,), "uint32", "uint32", tree.KEY, (2,))
    region, failed = ((0, 4), (0, 4)), ((4, 8), (0, 4))
    fill = Fill.__new__(Fill)
    fill.restart()
    fill.outputs = [same, bf, i32, key, 7]   # a Python scalar's output is no Output
    mine = {"['f']": [region, failed], "['b']": [region], "['i']": [region], "['k']": [((0, 4),)]}
    for index, out in enumerate(fill.outputs[:4]):   # the local pass reads these of its copy
        fill._reading_own(lambda index, o: ({}, mine[o.saved.keypath], {}))(index, out)
    landed = Landed()
    tap = landed.tap(lambda out, at, array, *stored: at != failed)   # the pass's check
    arrays = [np.zeros((4, 4), out.dtype) for out in (same, bf, i32)]
    for out, array in zip((same, bf, i32), arrays):
        tap(out, region, array)
    tap(same, failed, np.zeros((4, 4), np.float32))
    tap(key, ((0, 4),), keydata := np.arange(8, dtype=np.uint32).reshape(4, 2))
    landed.close()   # the pass is over: what has not landed will not
    have = fill.in_memory(landed)
    assert have("['f']", region) is arrays[0]
    assert have("['b']", region) is None and have("['i']", region) is None      # cast: read from the copy
    assert have("['k']", ((0, 4), (0, 2))) is keydata
    assert have("['f']", ((0, 2), (0, 4))) is None and have("['x']", region) is None
    assert have("['f']", failed) is None                                        # its read failed its check


def test_with_three_pieces_a_lost_process_is_rebuilt_through_holders_xoring_two_members(tmp_path):
    """``LocalTier(parity=3)`` over the 4 processes (ring 0, 2, 1, 3: each holder covers the 3
    others): process 2's disk wiped, each of its 3 pieces is finished by a holder that XORs the pieces
    of the group's 2 other members -- sent over the devices, from what they read in the local pass --
    into its parity row; the job resumes step 8 bit-exact, nothing from the root, process 2 receiving
    its rows once (3 pieces of a third) and each holder 2 pieces."""
    extra = {"DIO_TEST_PARITY": "3"}
    root, local = tmp_path / "root", tmp_path / "local" / "{process}"
    train_fsdp(root, local, extra)
    info = json.loads((tmp_path / "local" / "0" / "8" / "info.json").read_text())
    assert (info["parity"]["k"], info["durability"]) == (3, "parity 3"), info
    rows = sum(group["W"] for group in info["parity"]["groups"]) * 2   # a process's rows, 2 devices
    shutil.rmtree(str(local).replace("{process}", "2"))
    results = _run(root, local, "resume", extra=extra)
    print("parity 3, process 2 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert results[2][3] == SHARE, results             # 2: its share rebuilt, read from memory
    # holders 0, 3, 1 (pieces 0, 1, 2); 2 gets b from a peer too
    assert [r[5] for r in results] == [2 * rows // 3, 2 * rows // 3, rows + B, 2 * rows // 3], results


def test_a_lost_process_is_rebuilt_under_a_restore_that_casts_or_renames(tmp_path):
    """A restore with ``cast=True`` (w as bfloat16, m as float32) after process 1's disk is wiped:
    the members' buffers hold the cast values, so a rebuild cannot take them from memory
    (``Fill.in_memory``: only buffers as stored) -- it reads those regions from their copies -- and
    every process's result is the stored values cast, bit for bit, nothing from the root. One with the
    target's leaves renamed, read through ``names=`` (the members' buffers looked up by saved key path):
    bit-exact, nothing from the root, the holders receiving one piece each. A flipped
    byte in process 3's own w region (fed to process 1's piece 0 through process 2's group, k = 2)
    at step 6 sends process 1's k and m regions of that device, and that region of 3's, to the root,
    cast alike."""
    extra = {**PARITY, "DIO_TEST_CAST": "1"}
    root, local = _trained_then_lost(tmp_path, 1)
    results = _run(root, local, "resume", extra=extra)
    print("cast, process 1 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    results = _run(root, local, "resume", extra={**PARITY, "DIO_TEST_NAMES": "1"})   # the leaves renamed: names=
    print("names=, process 1 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert results[1][3] == SHARE and [r[5] for r in results] == [0, ROWS + B, ROWS // 2, ROWS // 2], results
    for p in (0, 2, 3):   # at step 6 (persisted), with a flipped byte in a member's region
        shutil.rmtree(tmp_path / "local" / str(p) / "8")
    sh.flip_byte(sh.chunks(tmp_path / "local" / "3" / "6", "['w']")[(7, 0)])    # rows 56:64, process 3's device 7
    results = _run(root, local, "resume", extra=extra)
    print("cast, process 1 lost, a bad member region:", results)
    assert all(r[1:3] == (6, True) for r in results), results
    km = 2 * 4 + 16 * 8 * 4                                  # a device's k[i:i+1] and m[:, 8i:8i+8] (bytes as stored)
    assert [r[4] for r in results] == [0, km, 0, 8 * 16 * 4], results


def test_the_leaders_lost_disk_is_rebuilt_its_own_leaf_too(tmp_path):
    """Process 0 -- the room's leader, the one holder of ``s`` (on its two devices; a small leaf read
    whole) -- loses its disk: its share and ``s`` are rebuilt from parity and placed from memory,
    bit-exact, nothing from the root; the manifest comes from process 1 (the first with a copy)."""
    root, local = _trained_then_lost(tmp_path, 0)
    results = _run(root, local, "resume")
    print("process 0 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert results[0][3] == SHARE + S, results     # its share and s, from its rebuilt copy


def test_a_lost_process_whose_regions_another_process_needs_is_rebuilt_first(tmp_path):
    """Onto the devices in reverse order, each process's regions are held by another: process 1's
    (lost) are read from its copy for process 2 (``Route.reader`` a lost process: the rebuild runs
    before the local pass, the members reading their regions from their copies, checked). Bit-exact,
    nothing from the root; each process receives the share it now holds (another's), the holders of
    process 1's pieces (0 and 2) one piece each, and process 1 its rows and b."""
    root, local = _trained_then_lost(tmp_path, 1)
    results = _run(root, local, "reversed")
    print("onto reversed devices, process 1 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results
    assert [r[5] for r in results] == [SHARE, SHARE + ROWS + B, SHARE + ROWS // 2, SHARE + ROWS // 2], results


def test_a_rebuild_takes_from_memory_only_what_the_member_read_of_its_own_copy():
    """A member whose own copy of a region was dropped (it could not be opened, or failed a check
    before the read) receives that region from a peer holding it too (a leaf replicated within one
    failure domain is parity-protected): its buffer is allocated empty and filled piece by piece, and
    a piece the peer's read found bad is not sent -- left as it was, until the next pass fills it again,
    after the rebuild. ``Fill.in_memory`` hands over only the regions this process read itself of its
    own copy in the local pass (the routes' own regions), never such a received buffer: the rebuild
    reads it from the copy (or loses the pieces it feeds), rather than XOR bytes no one checked into
    a lost process's regions (rebuilt regions carry no checksum of their own)."""
    import numpy as np

    from dispatch_io import tree
    from dispatch_io.manager.tiers.tier_fill import Fill, Landed
    from dispatch_io.manifest import SavedLeaf
    from dispatch_io.read.targets import DEVICE, Output
    from dispatch_io.workers import ArraySpec

    stored = ArraySpec("w", (8, 4), "float32", (4, 4))
    out = Output(SavedLeaf("['w']", tree.ARRAY, "jax", (8, 4), np.dtype("float32"), stored=stored),
                 DEVICE, np.dtype("float32"))
    own, received = ((0, 4), (0, 4)), ((4, 8), (0, 4))
    out.buffers[own] = np.ones((4, 4), np.float32)                  # read of its copy, checked
    out.buffers[received] = np.empty((4, 4), np.float32)            # a peer's piece never came
    fill = Fill.__new__(Fill)
    fill.restart()
    fill.outputs = [out]
    routes = fill._reading_own(lambda index, o: ({received: (0, 1)}, [own], {received: (1,)}))
    assert routes(0, out) == ({received: (0, 1)}, [own], {received: (1,)})   # the routes as they were
    landed = Landed()
    tap = landed.tap(lambda *checked: True)
    for region in (own, received):   # as if both had landed: only what it read itself is handed over
        tap(out, region, out.buffers[region])
    landed.close()
    have = fill.in_memory(landed)
    assert have("['w']", own) is out.buffers[own]
    assert have("['w']", received) is None


def test_a_rebuilt_region_read_whole_is_handed_over_and_a_part_of_it_copied():
    """A lost process places its rebuilt regions from memory (``MemoryReader``): a read of one whole
    region as rebuilt (same bounds and dtype) hands that array over -- no copy of its share --; a part
    of it, a read across two regions, or one as another dtype is copied, bit for bit; a region not
    rebuilt whole fails with a ChunkError."""
    import numpy as np

    from dispatch_io.manager.tiers.rebuild_reads import MemoryReader
    from dispatch_io.workers import ArraySpec, ChunkError, ReadItem, Region, crc32c

    rows = np.arange(64, dtype=np.float32).reshape(8, 8)
    regions = {"['w']": {((0, 4), (0, 8)): rows[:4], ((4, 8), (0, 8)): rows[4:]}}
    reader, spec = MemoryReader(regions), ArraySpec("w", (8, 8), "float32", (4, 8))

    def item(bounds, dtype="float32"):
        shape = tuple(hi - lo for lo, hi in bounds)
        return ReadItem(((Region(spec, bounds, "['w']"), tuple((0, n) for n in shape)),), shape, dtype)

    whole, part, across, cast = reader.read([item(((4, 8), (0, 8))), item(((1, 3), (2, 6))),
                                             item(((2, 6), (0, 8))), item(((0, 4), (0, 8)), "bfloat16")]).result()
    assert np.shares_memory(whole, rows) and whole.tobytes() == rows[4:].tobytes()
    assert not np.shares_memory(part, rows) and part.tobytes() == rows[1:3, 2:6].tobytes()
    assert across.tobytes() == rows[2:6].tobytes() and cast.dtype.name == "bfloat16"
    assert cast.astype(np.float32).tobytes() == rows[:4].tobytes()   # small integers: exact in bfloat16
    again, = reader.read([item(((4, 8), (0, 8)))]).result()   # a second result of it (names=): its own buffer
    assert not np.shares_memory(again, rows) and again.tobytes() == rows[4:].tobytes()
    assert reader.checksums([Region(spec, ((2, 6), (0, 8)), "['w']")]).result() == [crc32c(rows[2:6].copy())]
    del regions["['w']"][((4, 8), (0, 8))]
    try:
        reader.read([item(((2, 6), (0, 8)))]).result()
    except ChunkError:
        pass
    else:
        raise AssertionError("a region not rebuilt whole was read")


def test_a_rebuilt_region_restored_whole_onto_the_host_is_the_callers_to_write(monkeypatch):
    """A lost process's rebuilt regions are views of the rows as they came (read-only: numpy's view of
    the collective's result). One read whole onto a device is handed over as it is (``jax.device_put``
    copies or aliases it; nothing writes it), but a numpy result -- a leaf on the lost process's device
    alone, restored onto the host -- is the caller's, writable like any restore's, bit for bit: a rebuild
    must not make ``state["x"] += 1`` fail after a lost disk."""
    import jax
    import numpy as np

    from dispatch_io import tree
    from dispatch_io.manifest import SavedLeaf
    from dispatch_io.progress import Progress
    from dispatch_io.read import loop as reading
    from dispatch_io.read.targets import DEVICE, HOST, Output, finish
    from dispatch_io.manager.tiers.rebuild_reads import MemoryReader
    from dispatch_io.workers import ArraySpec

    own = np.arange(4, dtype=np.float32).reshape(2, 2) / 3   # 16 bytes, in the row's piece 1 (bytes 27 to 54)
    device = sorted(jax.devices(), key=lambda d: d.id)[1]
    rebuilt, failed, _ = _simulated_rebuild(monkeypatch, 4, 2, (1,), {**_mixed_tree(4), "own": jax.device_put(own, device)})
    assert failed == {1: {}}
    region = rebuilt[1]["['own']"][((0, 2), (0, 2))]
    assert not region.flags.writeable and region.tobytes() == own.tobytes()   # a view of a row as it came

    saved = SavedLeaf("['own']", tree.ARRAY, "jax", (2, 2), np.dtype("float32"),
                      stored=ArraySpec("own", (2, 2), "float32", (2, 2)))
    host = Output(saved, HOST, np.dtype("float32"))
    on_device = Output(saved, DEVICE, np.dtype("float32"), sharding=jax.sharding.SingleDeviceSharding(device))
    for out in (host, on_device):
        reading.read_outputs(MemoryReader(rebuilt[1]), [out], 1 << 20, 1 << 20,
                             Progress("restore", "rebuilt", enabled=False))
    assert np.shares_memory(on_device.buffers[((0, 2), (0, 2))], region)   # handed over: no copy
    result = finish(host)
    assert isinstance(result, np.ndarray) and result.tobytes() == own.tobytes()
    assert result.flags.writeable and not np.shares_memory(result, region), "a read-only numpy result"
    result += 1


def test_a_rebuild_beside_the_pass_takes_each_region_as_it_lands_checked():
    """``tier_fill.Landed``: the rebuild beside a local pass waits for a region until the pass's check
    passes it (then it has that very buffer), and a region the check leaves out, or one never read,
    ends its wait when the pass ends (None: the rebuild reads it from the copy)."""
    import threading

    import numpy as np

    from dispatch_io.manager.tiers.tier_fill import Landed
    from dispatch_io.manifest import SavedLeaf
    from dispatch_io.read.targets import DEVICE, Output
    from dispatch_io.workers import ArraySpec

    stored = ArraySpec("w", (8, 4), "float32", (4, 4))
    out = Output(SavedLeaf("['w']", "array", "jax", (8, 4), np.dtype("float32"), stored=stored), DEVICE,
                 np.dtype("float32"))
    good, bad = ((0, 4), (0, 4)), ((4, 8), (0, 4))
    landed = Landed()
    check = landed.tap(lambda o, region, array: region == good)   # the pass's check: passes one region
    got = {}
    waiting = [threading.Thread(target=lambda r=r: got.__setitem__(r, landed.wait("['w']", r))) for r in (good, bad)]
    for thread in waiting:
        thread.start()
    buffer = np.ones((4, 4), np.float32)
    assert check(out, good, buffer) is True and check(out, bad, np.zeros((4, 4), np.float32)) is False
    waiting[0].join(10)
    assert not waiting[0].is_alive() and got[good][2] is buffer and got[good][1] == good
    assert waiting[1].is_alive()   # left out by the check: waits for the pass to end
    landed.close()
    waiting[1].join(10)
    assert got[bad] == (None, None, None)
    kept = Landed(keep={("['w']", bad)})   # holds only what the rebuild may take: the rest can be freed
    kept.tap(lambda o, region, array: True)(out, good, buffer)
    kept.close()
    assert kept.wait("['w']", good) == (None, None, None)


def test_a_rebuild_waiting_beside_a_slow_pass_for_regions_it_does_not_read_does_not_time_out(tmp_path):
    """Onto a mesh of one device per process (``narrow``: the pass reads none of the regions a member's
    pieces are cut from as stored, so the rebuild beside it waits for the pass to end), with a slow disk
    (four of a member's own regions land 3 s late each: its pass takes longer than the 8 s barrier timeout,
    each region moving its deadline): the lost process and the holders wait at the rebuild's (one)
    ready barrier while the members read, and the members' progress moves that barrier's deadline too
    -- the job resumes step 8 bit-exact, nothing from the root, rather than a BarrierTimeoutError naming
    members that were reading all along."""
    root, local = _trained_then_lost(tmp_path, 1)
    results = _run(root, local, "narrow", extra={"DIO_TEST_SLOW_OWN_READS": "3"}, barrier_timeout=8)
    print("narrow, slow own reads, process 1 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results


def test_a_members_own_read_failing_beside_the_rebuild_fails_the_restore_everywhere_without_a_hang(tmp_path):
    """Process 3 (a member feeding process 1's pieces) has its own reads fail in the local pass beside
    the rebuild (an OSError, not a bad checksum: nothing to fall back on): every process's restore
    fails -- process 3 with its read's error naming it, the others naming process 3 -- within the
    barrier timeout, none left waiting in the rebuild (its thread ends: the pass's end ends its waits)."""
    import time

    root, local = _trained_then_lost(tmp_path, 1)
    started = time.monotonic()
    procs = start_job("job_fsdp_replicas.py", [root, local, "resume"], barrier_timeout=20,
                      extra={**PARITY, "DIO_TEST_FAILING_OWN_READS": "3"})
    outs = [p.communicate(timeout=150) for p in procs]
    assert all(p.returncode != 0 for p in procs), outs
    assert time.monotonic() - started < 120, outs
    assert "process 3's disk failed" in outs[3][1], outs[3][1][-3000:]
    for p in (0, 1, 2):
        assert re.search(r"(WorkerError|CheckpointError).*(worker|process) 3", outs[p][1]), outs[p][1][-3000:]


@pytest.mark.parametrize("k, lost", [(2, (1, 4)), (2, (0, 3)), (3, (2, 6)), (4, (5,)), (2, (7, 2))])
def test_a_rebuild_brings_back_lost_processes_sharing_holders_and_members_for_each_k(monkeypatch, k, lost):
    """k = 2, 3, 4 over 8 processes, lost processes as close as the plan allows (a holder of one lost
    process's piece is a member of another's chains, and a process sends in both phases): every lost
    region comes back bit for bit (checked in ``_simulated_rebuild``), none left out, each lost process
    receiving its row once."""
    rebuilt, failed, received = _simulated_rebuild(monkeypatch, 8, k, lost, _mixed_tree(8))
    assert failed == {p: {} for p in lost}
    assert all(len(rebuilt[p][kp]) == 1 for p in lost for kp in ("['bf']", "['f8']", "['f']", "['key']")), rebuilt
    assert len({received[p] for p in lost}) == 1 and received[lost[0]] > 0, received


@pytest.mark.parametrize("k, lost", [(3, (1, 5)), (4, (6,))])
def test_a_rebuild_of_several_row_groups_brings_back_regions_across_three_pieces(monkeypatch, k, lost):
    """Leaves of int8, float32 (160 bytes a device: across 3 pieces of a row of them alone, 4 with k = 4),
    bool, int4 and the mixed ones, in rows of at most 64 bytes (5 row groups): each group's pieces come in
    buffers of their own (nothing of one group's rounds is written by the next's), a region across 3 or
    more pieces is joined in order, and every lost region comes back bit for bit, none left out."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    on = NamedSharding(Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("x",)), P("x"))
    values = np.arange(-700, 700) * 37 % 251
    tree = {"a": jax.device_put(values[:24].astype(np.int8), on),
            "big": jax.device_put((values[:320] / 7).astype(np.float32).reshape(80, 4), on),
            "bo": jax.device_put((values[:40] % 2).astype(np.bool_), on),
            "i4": jax.device_put((values[:48] % 8).astype(jnp.int4), on), **_mixed_tree(8)}
    rebuilt, failed, _ = _simulated_rebuild(monkeypatch, 8, k, lost, tree, row_bytes=64)
    assert failed == {p: {} for p in lost}
    assert all(len(rebuilt[p][f"['{name}']"]) == 1 for p in lost for name in tree), rebuilt


def test_a_member_whose_own_regions_fail_fails_the_rebuild_everywhere_before_any_collective(monkeypatch):
    """k = 2 over 4 processes, process 1 lost: process 2 (a holder of one of its pieces and a member of
    the other's chain) has its parity rows in hand when its own regions fail to come (OSError packing
    its pieces): it raises that, every other process a CheckpointError naming it at the ready barrier --
    none is left in a round's collective without it."""
    from dispatch_io.errors import CheckpointError

    raised = _simulated_rebuild(monkeypatch, 4, 2, (1,), _mixed_tree(4), raising=(2,), timeout=10)
    assert isinstance(raised[2], OSError), raised
    assert all(isinstance(raised[p], CheckpointError) and "process 2" in str(raised[p]) for p in (0, 1, 3)), raised


def test_members_waiting_beside_a_pass_that_waits_for_a_slow_holder_do_not_time_out(tmp_path):
    """Onto the narrow mesh (the members' pieces' regions are not read as stored: their rebuild waits
    for their pass to end), process 0 -- a holder of lost process 1's pieces, no member -- reads its own
    regions slowly (four 3 s late each: 12 s, with an 8 s barrier timeout); members 2 and 3 read theirs at once, then their pass
    waits for process 0's at its last barrier (which moves with 0's progress). The lost process and the
    holders wait at the rebuild's ready barrier for the members, which read nothing more: the
    job must still resume step 8 bit-exact, rather than a BarrierTimeoutError naming a member that was
    only waiting for the slow holder's pass."""
    root, local = _trained_then_lost(tmp_path, 1)
    results = _run(root, local, "narrow", extra={"DIO_TEST_SLOW_OWN_READS": "3", "DIO_TEST_SLOW_OWN_READS_IN": "0"},
                   barrier_timeout=8)
    print("narrow, process 0's own reads slow, process 1 lost:", results)
    assert all(r[1:3] == (8, True) and r[4] == 0 and r[7] == 0 for r in results), results


def test_a_rebuild_waiting_beside_a_pass_that_reads_nothing_more_still_tells_its_progress():
    """``tier_fill.Landed``: while a wait goes on, ``progress`` is told every ``every`` seconds with a
    changing value even when the pass reads nothing (it may be waiting for a slower process's reads),
    so the others' barrier deadline moves until the pass ends the wait."""
    import threading
    import time

    from dispatch_io.manager.tiers.tier_fill import Landed

    told = []
    landed = Landed(lambda read, n: told.append((read, n)), every=0.05)
    waiting = threading.Thread(target=landed.wait, args=("['w']", ((0, 4),)))
    waiting.start()
    time.sleep(0.5)
    landed.close()
    waiting.join(10)
    assert not waiting.is_alive() and len(told) >= 3 and len(set(told)) == len(told), told
    assert all(read == 0 for read, _ in told), told
