"""Parity in the local tier, its pure plan (no devices, no IO): the ring, who covers whose pieces,
what a lost process is rebuilt from, which lost processes can be rebuilt, and what it costs."""

import collections
import functools

import numpy as np
import pytest

from dispatch_io.manager.tiers import parity_plan as pp
from dispatch_io.manager.tiers import placement


def test_the_ring_interleaves_failure_domains():
    assert pp.ring((0, 0, 1, 1)) == (0, 2, 1, 3)
    assert pp.ring(("a", "a", "a", "b", "b", "c")) == (0, 3, 5, 1, 4, 2)
    assert pp.ring(range(5)) == (0, 1, 2, 3, 4)


@pytest.mark.parametrize("n", range(3, 8))
def test_every_piece_of_every_process_is_covered_once_by_a_holder_outside_its_group(n):
    for k in range(2, n):
        order = pp.ring([p % 2 for p in range(n)])
        covered = pp.members(order, k)
        pieces = collections.Counter((m, j) for h, group in covered.items() for j, m in enumerate(group))
        assert set(pieces) == {(p, j) for p in range(n) for j in range(k)} and set(pieces.values()) == {1}
        assert all(h not in group and len(set(group)) == k for h, group in covered.items())
        for lost in range(n):   # piece j of a lost process: its holder's row minus the k - 1 other members' pieces
            for j, holder, others in pp.sources(order, k, lost):
                assert covered[holder][j] == lost and lost not in [m for m, _ in others]
                assert sorted([j] + [i for _, i in others]) == list(range(k))
                assert all(covered[holder][i] == m for m, i in others)


def _section(order, k, holder, regions):
    """The parity section process ``holder`` records: one group of one leaf, one device each."""
    group = {"leaves": ["w"], "offsets": [0], "widths": [8], "itemsize": [4], "trail": [[]], "W": 8}
    covered = pp.members(order, k)[holder]
    return {"k": k, "ring": list(order), "groups": [group],
            "layouts": {str(p): [[[regions[p]]]] for p in (holder, *covered)}}


def _reports(n, k, lost, committed=None):
    order = tuple(range(n))
    regions = {p: [[2 * p, 2 * p + 2]] for p in range(n)}
    return {p: {"held": {"w": {((2 * p, 2 * p + 2),)}}, "parity": _section(order, k, p, regions),
                "committed": committed is None or p in committed}
            for p in range(n) if p not in lost}


def test_one_lost_process_is_rebuilt_two_in_one_group_are_not_two_in_different_groups_are():
    assert pp.rebuildable(_reports(4, 2, {1}), 4) == {1: {"w": {((2, 4),)}}}
    assert pp.rebuildable(_reports(4, 2, {1, 2}), 4) == {}           # 2 is in a group covering 1's pieces
    assert pp.rebuildable(_reports(4, 3, {0, 2}), 4) == {}
    # n = 6, k = 2: process 0 is rebuilt from 5, 4 (holders) and 1, 5 (members); 3 from 2, 1 and 4, 2
    assert pp.rebuildable(_reports(6, 2, {0, 3}), 6) == {0: {"w": {((0, 2),)}}, 3: {"w": {((6, 8),)}}}
    assert pp.rebuildable(_reports(6, 2, {0, 1}), 6) == {}
    # a holder whose parity rows did not commit: its pieces are gone
    assert pp.rebuildable(_reports(4, 2, {1}, committed={2, 3}), 4) == {}
    assert pp.rebuildable(_reports(4, 2, {1}, committed={0, 3}), 4) == {1: {"w": {((2, 4),)}}}
    # ids permuted on a restart: 0's host lost, 2 restarted as 0, a new host is 2. Index 2 has no copy; its
    # holders (1, 0) and other members (3, 1) all have one -- but 0's is 2's, its parity rows of 2's place in
    # the ring (their XOR with 3's and 1's pieces is not 2's regions): nothing is rebuilt
    reports = _reports(4, 2, {2})
    assert pp.rebuildable(reports, 4) == {2: {"w": {((4, 6),)}}}
    reports[0] = {**_reports(4, 2, set())[2], "process": 2}
    assert pp.rebuildable(reports, 4) == {}
    # a member that lost its own region (a bad chunk dropped it): the group cannot be XORed out
    reports = _reports(4, 2, {1})
    reports[2]["held"] = {}
    assert pp.rebuildable(reports, 4) == {}


def test_rebuilt_steps_make_a_step_whole_with_its_parity_durability():
    reports = {p: {8: {**r, "held": {"w": [[[2 * p, 2 * p + 2]]]}, "shapes": {"w": [8]}, "copies": 1}}
               for p, r in _reports(4, 2, {1}).items()}
    rebuilt = pp.rebuilt_steps(reports, 4)
    assert rebuilt == {8: {1: {"w": {((2, 4),)}}}}
    assert placement.whole_steps(reports, []) == {}                  # without the rebuild: w[2:4] is lost
    reports[1] = {8: {**reports[0][8], "held": {"w": [[[2, 4]]]}}}
    assert placement.whole_steps(reports, []) == {8: "parity 2"}
    assert placement.eligible("replicated", [], {8: placement.copies_of(reports[0][8])}) == {8}
    assert placement.eligible("replicated", [], {8: placement.copies_of({"copies": 1})}) == set()
    # parity rows that never committed (killed between the step's commit and theirs): no second copy
    assert placement.eligible("replicated", [], {8: placement.copies_of({**reports[0][8], "committed": False})}) == set()


def test_storage_per_process_is_its_share_and_one_kth_of_its_rows():
    group = {"leaves": ["a", "b"], "offsets": [0, 40], "widths": [40, 24], "itemsize": [4, 2], "trail": [[], [2]],
             "W": 64}
    section = {"k": 2, "ring": [0, 1, 2], "groups": [group, {**group, "W": 30}]}
    assert pp.storage(section, own=2) == (64 // 2 + 30 // 2) * 2
    # what a bad piece loses: the leaves with a byte in it
    regions = [[[0, 10]], [[0, 3]]]      # a: 10 x 4 bytes at 0; b: 3 x 2 x 2 bytes at 40
    assert pp.spans(group, regions) == [("a", ((0, 10),), 0, 40), ("b", ((0, 3),), 40, 12)]
    assert pp.hit(group, regions, 2, {0}) == [("a", ((0, 10),))]
    assert pp.hit(group, regions, 2, {1}) == [("a", ((0, 10),)), ("b", ((0, 3),))]


def test_choices_it_cannot_keep_are_refused_by_name():
    with pytest.raises(ValueError, match="replicas=1"):
        pp.check(1, 4)
    with pytest.raises(ValueError, match="choose one"):
        pp.check(2, 4, replicas=1)
    with pytest.raises(ValueError, match="at least 5 processes"):
        pp.check(4, 4)
    assert pp.check(3, 4) == 3
    import dispatch_io as dio
    with pytest.raises(ValueError, match="replicas=1"):
        dio.LocalTier("/tmp/local/{process}", parity=1)
    with pytest.raises(ValueError, match="choose one"):
        dio.LocalTier("/tmp/local/{process}", parity=2, replicas=1)
    with pytest.raises(ValueError, match="an integer >= 2"):
        dio.LocalTier("/tmp/local/{process}", parity="2")
    assert dio.LocalTier("/tmp/local/{process}", parity=None).parity is None   # no parity, as parity=0
    for other in (False, 0.0, "", []):   # not 0 or None: refused, never taken silently for no parity
        with pytest.raises(ValueError, match=r"an integer >= 2, .*0 or None: no parity"):
            dio.LocalTier("/tmp/local/{process}", parity=other)


def test_a_step_whose_parity_did_not_commit_everywhere_is_not_called_parity():
    reports = {p: {8: {**r, "held": {"w": [[[2 * p, 2 * p + 2]]]}, "shapes": {"w": [8]}, "copies": 1}}
               for p, r in _reports(4, 2, set(), committed={0, 1, 2}).items()}
    assert placement.whole_steps(reports, []) == {8: "local"}
    reports[3][8]["committed"] = True
    assert placement.whole_steps(reports, []) == {8: "parity 2"}


@pytest.mark.parametrize("n", range(3, 9))
def test_the_transfer_rounds_bring_each_lost_row_back_receiving_it_once(n):
    """The rounds, run on random rows: each lost process's row comes back bit for bit, from its k pieces
    alone (each piece's chain ends in it: the share crosses once), no process sends or receives twice
    in a round, the early rounds carry only holders' parity rows (no member's row is needed before the
    late ones), a hop never comes before the one that brings what it sends on, and after the members'
    rows are in hand the lost processes wait k - 2 rounds along the chains, then receive k."""
    rng = np.random.default_rng(n)
    for k in range(2, n):
        order = pp.ring([p % 2 for p in range(n)])
        width = 4
        rows = {p: rng.integers(0, 256, k * width, dtype="uint8") for p in range(n)}
        piece = lambda p, j: rows[p][j * width:(j + 1) * width]  # noqa: E731
        parity = {h: functools.reduce(lambda a, b: a ^ b, (piece(m, j) for j, m in enumerate(group)))
                  for h, group in pp.members(order, k).items()}
        # lost processes one per group: every (k + 1)-th place of the ring from a random start
        start = int(rng.integers(n))
        lost = {order[(start + t) % n] for t in range(0, n - k, k + 1)}
        got = {p: {} for p in lost}
        carried = {}   # (lost, j) -> (the process holding the partial sum, the sum)
        early, late = pp.transfers(order, k, lost)
        for r, moves in enumerate(early + late):
            assert len({m[0] for m in moves}) == len(moves) == len({m[1] for m in moves}), moves
            arriving = {}
            for sender, receiver, p, j, i in moves:
                assert sender not in lost and (r < len(early)) == (i is None)
                if i is None:                      # a holder's parity row starts the chain
                    assert pp.members(order, k)[sender][j] == p and (p, j) not in carried
                    value = parity[sender]
                else:                              # a member XORs its piece in and sends it on
                    holder = next(h for h, g in pp.members(order, k).items() if g[j] == p)
                    assert carried[(p, j)][0] == sender and pp.members(order, k)[holder][i] == sender
                    value = carried.pop((p, j))[1] ^ piece(sender, i)
                arriving[(p, j)] = (receiver, value)
            for (p, j), (receiver, value) in arriving.items():   # what a round brings is sent on in a later one
                if receiver == p:
                    got[p][j] = value
                else:
                    carried[(p, j)] = (receiver, value)
        assert len(late) == (k - 2) + k or not lost
        for p in lost:
            assert sorted(got[p]) == list(range(k))            # k pieces of 1/k: its row once
            assert b"".join(got[p][j].tobytes() for j in range(k)) == rows[p].tobytes()


def _valid_lost_sets(order, k):
    """Every set of lost processes parity rebuilds (as ``rebuildable`` allows: no holder and no other
    member of a lost process's groups lost too), by their ring positions."""
    import itertools
    n = len(order)
    for size in range(1, n // (k + 1) + 1):
        for lost in itertools.combinations(order, size):
            if all(h not in lost and all(m not in lost for m, _ in others)
                   for p in lost for _, h, others in pp.sources(order, k, p)):
                yield set(lost)


@pytest.mark.parametrize("k", (2, 3, 4))
def test_every_rebuildable_lost_set_comes_back_through_each_processs_own_view_of_the_rounds(k):
    """For k = 2, 3, 4 and every set of lost processes the plan allows (two lost processes sharing a
    holder-and-member, at any spacing; k = 4 with two lost needs 10 processes), each process runs only
    the rounds it is in, as ``rebuild_rounds.exchange`` does, with one row per (lost, j) it sends and
    the sums that came to it keyed by (lost, j): a sum is never popped twice nor left over, a row
    keyed (lost, j) is sent once, and every lost row comes back bit for bit."""
    rng = np.random.default_rng(k)
    for n in range(k + 1, 3 * (k + 1) + 1):
        order = pp.ring([p % 3 for p in range(n)])
        covered = pp.members(order, k)
        rows = {p: rng.integers(0, 256, k, dtype="uint8") for p in range(n)}   # one byte a piece
        parity = {h: np.bitwise_xor.reduce([rows[m][j] for j, m in enumerate(g)]) for h, g in covered.items()}
        for lost in _valid_lost_sets(order, k):
            early, late = pp.transfers(order, k, lost)
            partial = {p: {} for p in range(n)}
            sent = {p: set() for p in range(n)}
            got = {p: {} for p in lost}
            for moves in early + late:
                wire = {}
                for sender, receiver, p, j, i in moves:   # each sender's side, as exchange packs its row
                    assert (p, j) not in sent[sender], (n, lost, sender, p, j)
                    sent[sender].add((p, j))
                    wire[receiver] = (sender, p, j, parity[sender] if i is None else
                                      partial[sender].pop((p, j)) ^ rows[sender][i])
                for receiver, (sender, p, j, value) in wire.items():
                    if receiver == p:
                        got[p][j] = value
                    else:
                        assert (p, j) not in partial[receiver]
                        partial[receiver][(p, j)] = value
            assert not any(partial.values()), (n, lost, partial)
            for p in lost:
                assert [got[p].get(j) for j in range(k)] == list(rows[p]), (n, lost, p)


def test_carried_places_a_rows_bytes_in_the_transfers_of_its_pieces():
    """Pieces of 10 bytes, 3 device positions: bytes 5..27 of position 1's row lie in pieces 0, 1, 2,
    each at position 1's place in that piece's transfer (every position's piece j in turn), and the
    parts, joined in order, are the bytes; pieces not asked for, or not touched, are left out."""
    from dispatch_io.manager.tiers.parity_plan import carried

    row = bytes(range(30))                              # position 1's row: 3 pieces of 10 bytes
    transfers = {j: bytes(10) + row[10 * j:10 * (j + 1)] + bytes(10) for j in range(3)}
    found = carried(1, 5, 22, 10, range(3))
    assert [(j, at.start, at.stop, part.start, part.stop) for j, at, part in found] == \
        [(0, 15, 20, 0, 5), (1, 10, 20, 5, 15), (2, 10, 17, 15, 22)]
    assert b"".join(transfers[j][at] for j, at, _ in found) == row[5:27]
    assert [j for j, _, _ in carried(1, 5, 22, 10, {2, 0})] == [0, 2]
    assert carried(0, 12, 3, 10, {0, 2}) == [] and carried(2, 12, 0, 10, range(3)) == []
