"""The scale-out restore's split (``dispatch_io.multihost.scaleout.plan_split``): pure, so checked here in
one process for a job of several (host results are wanted by every process of the job). The
restore itself runs in tests/test_multiprocess.py."""

from __future__ import annotations

import itertools

import numpy as np

import dispatch_io as dio
from dispatch_io.read import targets
from dispatch_io.formats import detect as formats
from dispatch_io.plan.batches import aligned
from dispatch_io.multihost.delivery import width
from dispatch_io.multihost.scaleout import plan_split

KiB = 1 << 10


def _outputs(tmp_path):
    rng = np.random.default_rng(0)
    tree = {"big": rng.standard_normal((256, 256)).astype(np.float32),      # 256 KiB
            "small": np.arange(10, dtype=np.int16), "empty": np.zeros((0, 3), np.float32), "step": 7}
    with dio.LocalDispatcher(host_memory_budget=1 << 20, max_chunk_bytes=16 * KiB) as d:
        d.save(tmp_path / "ckpt", tree).wait()
    manifest = formats.open_checkpoint(tmp_path / "ckpt").manifest
    return lambda: targets.plan_outputs(manifest, None, partial=False, cast=False)[1]


def test_every_piece_has_one_reader_and_the_loads_balance(tmp_path):
    make = _outputs(tmp_path)
    count, chunk, batch = 3, 16 * KiB, 96 * KiB
    splits = [plan_split(make(), p, count, chunk, batch) for p in range(count)]
    assert len({s.digest for s in splits}) == 1            # every process planned the same
    assert all(s.local == [] for s in splits)              # host results are wanted by all
    rounds = splits[0].rounds
    pieces = [piece for r in rounds for row in r.rows.values() for piece in row]
    assert all(piece.holders == (0, 1, 2) and piece.nbytes <= chunk for piece in pieces)
    loads = [sum(p.nbytes for p in pieces if p.reader == r) for r in range(count)]
    assert sum(loads) == 256 * 256 * 4 + 20 and max(loads) - min(loads) <= chunk, loads
    for r in rounds:   # a row is at most its process's share of the batch, one piece at least
        for row in r.rows.values():
            size = sum(aligned(p.nbytes) for p in row)
            assert size <= r.width and (size <= batch // count or len(row) == 1), (size, r.width)
    # the pieces of each region tile its buffer exactly once
    outputs = make()
    for index, out in enumerate(outputs):
        if not isinstance(out, targets.Output) or out.saved.stored is None:
            continue
        shape = out.buffer_shape(next(iter(targets.output_regions(out))))
        covered = np.zeros(shape, np.int8)
        for piece in (p for p in pieces if p.output == index):
            covered[tuple(slice(lo, hi) for lo, hi in piece.local)] += 1
        assert (covered == 1).all(), out.saved.keypath


def test_a_lone_process_reads_everything_itself(tmp_path):
    split = plan_split(_outputs(tmp_path)(), 0, 1, 16 * KiB, 96 * KiB)
    assert split.rounds == [] and {out.saved.keypath for out, _ in split.local} == {"['big']", "['small']"}


def test_row_widths_are_few(tmp_path):
    widths = {width(n) for n in itertools.chain(range(1, 5000, 7), range(10**6, 2 * 10**6, 997))}
    assert all(w % 64 == 0 for w in widths)
    assert all(n <= width(n) <= max(64, n * 17 // 16 + 64) for n in range(1, 100000, 13))
    assert len(widths) < 120


def test_the_regions_asked_for_first_are_read_first_in_batches_of_their_own(tmp_path):
    """``plan_split(first=)`` puts those local regions ahead of the others (the rest in order), and
    ``RegionReads(apart=)`` batches them apart and small, so they land before the rest is read (a
    parity rebuild beside the local pass waits for them)."""
    from dispatch_io.read.loop import RegionReads

    make = _outputs(tmp_path)
    plain = plan_split(make(), 0, 1, 16 * KiB, 96 * KiB)
    big = [(out.saved.keypath, region) for out, region in plain.local if out.saved.keypath == "['big']"]
    assert [out.saved.keypath for out, _ in plain.local] == ["['big']", "['small']"]
    first = frozenset(big)
    split = plan_split(make(), 0, 1, 16 * KiB, 96 * KiB, first=first)
    assert [(out.saved.keypath, region) for out, region in split.local][:len(big)] == big and split.first == len(big)
    split = plan_split(make(), 0, 1, 16 * KiB, 96 * KiB, first=frozenset({("['small']", ((0, 10),))}))
    assert [out.saved.keypath for out, _ in split.local] == ["['small']", "['big']"]
    reads = RegionReads(None, split.local, 16 * KiB, 96 * KiB, "ckpt", apart=1)
    assert [[out.saved.keypath for out, _, _ in batch] for batch in reads.batches] == [["['small']"], ["['big']"]]
    assert reads.fence is reads.batches[1]   # the rest waits for them (``pipelined(fence=)``)
    whole = RegionReads(None, split.local, 16 * KiB, 1 << 20, "ckpt")
    assert len(whole.batches) == 1 and whole.fence is None   # without apart: one batch of both


def test_a_fenced_batch_waits_until_every_batch_before_it_is_consumed():
    """``pipelined(fence=)``: two batches in flight, but the fenced one (the first batch of the rest,
    after the regions a rebuild waits for) is submitted only once those before it are consumed --
    they land without sharing the reader with it; the others overlap as before."""
    import concurrent.futures

    from dispatch_io.progress import Progress
    from dispatch_io.read.loop import pipelined

    events = []

    def submit(batch):
        events.append(("submit", batch[0]))
        done = concurrent.futures.Future()
        done.set_result(batch[0])
        return done

    def run(fence):
        events.clear()
        pipelined([["a"], ["b"], ["c"], ["d"]], submit, lambda batch, result: events.append(("consume", result)),
                  lambda batch: 1, Progress("restore", "x", enabled=False), "read", lambda exc, batch: exc,
                  fence=fence)
        return events[:]

    fenced = run(lambda batch: batch == ["c"])
    assert fenced.index(("submit", "c")) > fenced.index(("consume", "b"))
    assert fenced.index(("submit", "b")) < fenced.index(("consume", "a"))   # a and b still overlap
    plain = run(None)
    assert plain.index(("submit", "c")) < plain.index(("consume", "b"))     # without: c read beside b
    assert [e for e in fenced if e[0] == "consume"] == [("consume", x) for x in "abcd"]
