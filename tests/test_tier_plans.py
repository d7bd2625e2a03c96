"""The local tier's pure planners on plain data (no devices, no IO): which step a restore takes and
where each region of it comes from, which steps are whole, where replicas go and which leaves need
them, and how leaves travel in rows."""

import pytest

from conftest import R, WANTED, held
from dispatch_io.manager.tiers import placement, replica_plan
from dispatch_io.manager.tiers.placement import PEER, PERSISTENT, Route, TierPlan, plan_restore


def reports(steps_of):
    return {p: {s: held(p) for s in steps} for p, steps in steps_of.items()}

def test_every_holder_with_its_own_copy_reads_it_and_nothing_travels():
    plan = plan_restore(WANTED, reports({p: [2, 4] for p in range(4)}), persistent_steps=[0])
    assert plan.step == 4 and not plan.persisted
    assert plan.routes["['w']"][R[0]] == Route((0, 2)) and plan.regions(PEER) == plan.regions(PERSISTENT) == 0


def test_a_lost_process_gets_its_regions_from_the_other_holder():
    plan = plan_restore(WANTED, reports({0: [8], 1: [], 2: [8], 3: [8]}), persistent_steps=[6])
    assert plan.step == 8
    assert plan.routes["['w']"][R[2]] == Route((3,), PEER, (1,), reader=3)
    assert plan.routes["['w']"][R[0]] == Route((0, 2))
    assert plan.routes["['b']"][((0, 32),)] == Route((0, 2, 3), PEER, (1,), reader=0)   # 3 reads two already
    assert plan.regions(PEER) == 3 and plan.regions(PERSISTENT) == 0


def test_both_holders_lost_goes_back_to_the_newest_persistent_step_reading_only_their_regions():
    plan = plan_restore(WANTED, reports({0: [], 1: [4, 6, 8], 2: [], 3: [6, 8]}), persistent_steps=[0, 6])
    assert plan.step == 6 and plan.persisted
    assert plan.routes["['w']"][R[0]] == Route((), PERSISTENT, (0, 2))
    assert plan.routes["['w']"][R[2]] == Route((1, 3))
    assert plan.routes["['b']"][((0, 32),)] == Route((1, 3), PEER, (0, 2), reader=1)
    assert plan.regions(PERSISTENT) == 2


def test_a_step_some_process_did_not_finish_is_skipped():
    # Process 2 was killed during its local save of 10 (never committed); 0 had one: step 10 is
    # still whole (0 holds regions 0, 1) -- but not if 0 lost it too.
    plan = plan_restore(WANTED, reports({0: [8, 10], 1: [8, 10], 2: [8], 3: [8, 10]}), persistent_steps=[])
    assert plan.step == 10 and plan.routes["['w']"][R[0]] == Route((0,), PEER, (2,), reader=0)
    plan = plan_restore(WANTED, reports({0: [8], 1: [8, 10], 2: [8], 3: [8, 10]}), persistent_steps=[])
    assert plan.step == 8


def test_copies_are_matched_by_the_regions_they_hold_not_by_process_id():
    # Processes 0 and 1 restarted on each other's hosts: a holder's copy is preferred...
    swapped = {0: {4: held(1)}, 1: {4: held(0)}, 2: {4: held(2)}, 3: {4: held(3)}}
    plan = plan_restore(WANTED, swapped, persistent_steps=[])
    assert plan.step == 4 and plan.routes["['w']"][R[0]] == Route((2,), PEER, (0,), reader=2)
    # ...and where no holder has one, any process's copy is read and delivered to the holders.
    plan = plan_restore(WANTED, {0: {4: held(1)}, 1: {4: held(0)}}, persistent_steps=[])
    assert plan.step == 4 and plan.routes["['w']"][R[0]] == Route((), PEER, (0, 2), reader=1)
    assert plan.routes["['w']"][R[2]] == Route((), PEER, (1, 3), reader=0)
    assert plan.regions(PEER) == 5 and plan.regions(PERSISTENT) == 0   # b too: 2 and 3 lost theirs


def test_nothing_anywhere_is_none_and_a_persistent_step_alone_is_read_whole():
    assert plan_restore(WANTED, reports({p: [] for p in range(4)}), persistent_steps=[]) is None
    plan = plan_restore(WANTED, {}, persistent_steps=[3])
    assert isinstance(plan, TierPlan) and plan.step == 3 and plan.regions(PERSISTENT) == 5


def test_a_required_durability_limits_the_steps_a_restore_may_pick():
    """Step 8 is only local with one copy of some region, step 6 local with two, step 4 persisted:
    each requirement picks the newest step that meets it -- still read from the local copies."""
    from dispatch_io.manager.tiers.placement import check_durability, durability, eligible
    steps = reports({p: [4, 6, 8] for p in range(4)})
    copies = {8: 1, 6: 2, 4: 2}
    picked = {require: plan_restore(WANTED, steps, [4], eligible(require, [4], copies))
              for require in ("local", "replicated", "persisted")}
    assert {r: (p.step, p.persisted) for r, p in picked.items()} == {
        "local": (8, False), "replicated": (6, False), "persisted": (4, True)}
    assert picked["persisted"].regions(PERSISTENT) == 0                    # its local copies serve it
    assert plan_restore(WANTED, reports({p: [8] for p in range(4)}), [], eligible("replicated", [], {8: 1})) is None
    assert [durability(1, False), durability(2, False), durability(3, True), durability(None, False)] == [
        "local", "replicated 2", "persisted", "local"]
    for bad in ("durable", None, 2):
        try:
            check_durability(bad)
        except ValueError as exc:
            assert "'local', 'replicated', 'persisted'" in str(exc)
        else:
            raise AssertionError(f"{bad!r} accepted")


def test_a_target_on_another_mesh_is_cut_from_the_copies_that_make_it_up():
    """Saved as 4 row blocks (held by {0, 2} / {1, 3}), restored as 2 blocks wanted by everyone: a
    process with both parts reads its block itself, the others receive it, each part read by one
    of its holders; a block with a part nobody kept needs the persistent step."""
    W = [((0, 32), (0, 16)), ((32, 64), (0, 16))]
    wanted = {"['w']": {W[0]: (0, 1, 2, 3), W[1]: (0, 1, 2, 3)}}
    steps = {p: {8: {"['w']": {r for r, holders in WANTED["['w']"].items() if p in holders}}} for p in range(4)}
    plan = plan_restore(wanted, steps, persistent_steps=[6])
    assert plan.step == 8 and plan.regions(PERSISTENT) == 0
    assert plan.routes["['w']"][W[0]] == Route((0, 2), PEER, (1, 3), parts=((R[0], (0, 2)), (R[1], (0, 2))))
    assert plan.routes["['w']"][W[1]] == Route((1, 3), PEER, (0, 2), parts=((R[2], (1, 3)), (R[3], (1, 3))))
    one = {p: {8: {"['w']": {R[0]} if p == 0 else set()}} for p in range(4)}
    assert plan_restore({"['w']": {W[0]: (0,)}}, one, []) is None          # R[1] kept nowhere
    assert plan_restore({"['w']": {W[0]: (0,)}}, one, [6]).routes["['w']"][W[0]].kind == PERSISTENT


def test_whole_steps_are_those_every_region_of_which_some_process_holds():
    half = lambda lo, hi: {"held": {"w": [[[lo, hi], [0, 4]]]}, "shapes": {"w": [8, 4]}}  # noqa: E731
    reports = {0: {5: half(0, 4), 7: half(0, 4), 9: half(0, 4)}, 1: {5: half(4, 8), 9: {"held": {}}},
               2: {7: {"held": {"w": [[[4, 6], [0, 4]], [[6, 8], [0, 4]]]}}}}   # 7: regions of two meshes
    assert placement.whole_steps(reports, [3]) == {3: "persisted", 5: "local", 7: "local"}
    assert placement.whole_steps({0: {4: {"held": {"w": [[[0, 8], [0, 4]]]}}}}, []) == {}   # no shapes recorded
    assert placement.whole_steps({0: {4: {**half(0, 8), "shapes": {"w": ["8", 4]}}}}, [1]) == {1: "persisted"}
    copied = {p: {4: {**half(0, 8), "copies": n}} for p, n in ((0, 2), (1, 3))}   # the fewest copies recorded
    assert placement.whole_steps(copied, []) == {4: "replicated 2"}


@pytest.mark.parametrize("domains, expected", [
    ((0, 0, 1, 1), [(2, 3, 0, 1)]),                       # the other host
    (("a", "b", "a", "b"), [(1, 0, 3, 2)]),               # domains interleaved by process index
    ((0, 1, 2, 3), [(1, 2, 3, 0)]),                       # one process per host: the next one
    ((7, 7, 7, 7), [(1, 2, 3, 0)]),                       # one host: another process at least
])
def test_replica_orders_put_each_copy_in_another_domain(domains, expected):
    assert replica_plan.replica_orders(domains, 1) == expected


def test_replica_orders_for_two_replicas_use_distinct_processes_and_refuse_too_few():
    orders = replica_plan.replica_orders((0, 0, 1, 1, 2, 2), 2)
    for p in range(6):
        places = {p} | {order[p] for order in orders}
        assert len(places) == 3 and len({(0, 0, 1, 1, 2, 2)[q] for q in places}) == 3, orders
    with pytest.raises(ValueError, match="replicas=2.*3 processes.*has 2"):
        replica_plan.replica_orders((0, 1), 2)


def test_replicas_needed_counts_data_parallel_replicas():
    orders = replica_plan.replica_orders((0, 0, 1, 1), 1)
    assert replica_plan.replicas_needed([{0, 2}, {1, 3}], orders, 1) == 0      # data=2: already two holders
    assert replica_plan.replicas_needed([{0}, {1}, {2}, {3}], orders, 1) == 1  # pure FSDP: one copy each
    assert replica_plan.replicas_needed([{0, 1, 2, 3}], orders, 1) == 0        # replicated everywhere
    # A region whose only holders are swapped by the order gains nothing from it: reported, not hidden.
    assert replica_plan.replicas_needed([{0, 2}], orders, 2) == 1


def test_leaves_travel_in_rows_of_one_dtype_within_the_row_budget():
    """``rows.groups``: one group per dtype while the row fits; a larger leaf travels alone; rows of
    bytes (parity's) take every dtype."""
    from types import SimpleNamespace

    import numpy as np

    from dispatch_io.manager.tiers.packed_rows import Leaf, groups

    def leaf(name, dtype, width):
        return Leaf(name, SimpleNamespace(dtype=np.dtype(dtype)), {}, width, 1, 1)

    def _groups(leaves, row_bytes, by_dtype=True):
        return groups(leaves, row_bytes, by_dtype)

    leaves = [leaf("a", "f4", 10), leaf("b", "i4", 10), leaf("c", "f4", 10), leaf("d", "f4", 100), leaf("e", "f4", 1)]
    assert [[x.keypath for x in g] for g in _groups(leaves, row_bytes=80)] == [["a", "c"], ["d"], ["e"], ["b"]]
    assert [[x.keypath for x in g] for g in _groups(leaves, row_bytes=1 << 20)] == [["a", "c", "d", "e"], ["b"]]
    assert [[x.keypath for x in g] for g in _groups(leaves, 80, by_dtype=False)] == [["a", "b"], ["c"], ["d"], ["e"]]
