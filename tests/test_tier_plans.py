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
    # A process that died between the job's agreement and its info's rewrite still says one copy, not
    # agreed: the infos that say agreed record what the job reached, and they count.
    late = {0: {4: {**half(0, 8), "copies": 2, "agreed": True}}, 1: {4: {**half(0, 8), "copies": 1, "agreed": False}}}
    assert placement.whole_steps(late, []) == {4: "replicated 2"}
    assert placement.agreed_reports({0: {"copies": 1, "agreed": False}}) == [{"copies": 1, "agreed": False}]


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


def _spans(domains, orders):
    """Per process: the failure domains its regions and their replicas span under ``orders`` (which
    must put no replica on the process itself and its replicas on distinct processes)."""
    spans = []
    for p in range(len(domains)):
        places = [p] + [order[p] for order in orders]
        assert len(set(places)) == len(places), (p, orders)
        spans.append(len({domains[q] for q in places}))
    return spans


@pytest.mark.parametrize("domains, replicas, count", [
    ((0, 0, 1, 1), 1, 2),                  # two hosts of two: the other host's two processes
    (("a", "b", "a", "b"), 1, 2),          # domains interleaved by process index
    ((0, 1, 2, 3), 1, 3),                  # one process per host: any other one
    ((7, 7, 7, 7), 1, 3),                  # one host: another process at least
    ((0, 0, 0, 1, 1), 1, 2),               # unequal hosts: the third of host 0 cannot leave it
    ((0, 0, 1, 1, 2, 2), 2, 2),            # two replicas: three hosts each time
    (tuple(range(8)), 1, replica_plan.SPREAD),   # capped: each variant is one more collective
])
def test_replica_variants_keep_the_domain_rule_with_other_peers(domains, replicas, count):
    """Every variant keeps what :func:`replica_orders` promises (no replica on its process, distinct
    holders, as many domains spanned -- the fewest and in all), and each gives every process a first
    replica holder no other variant does: a process's leaves sent by different variants land on different peers."""
    variants = replica_plan.replica_variants(domains, replicas)
    base = _spans(domains, replica_plan.replica_orders(domains, replicas))
    assert list(variants[0]) == replica_plan.replica_orders(domains, replicas) and len(variants) == count, variants
    for orders in variants:
        assert len(orders) == replicas and all(sorted(order) == list(range(len(domains))) for order in orders)
        spans = _spans(domains, orders)
        assert min(spans) >= min(base) and sum(spans) >= sum(base), (orders, spans, base)
    for p in range(len(domains)):
        assert len({orders[0][p] for orders in variants}) == len(variants), variants
    assert replica_plan.replica_variants((0, 0, 1, 1), 1) == [((2, 3, 0, 1),), ((3, 2, 1, 0),)]


def test_assign_variants_splits_each_process_share_within_one_leaf():
    """Leaves of random sizes over 4 processes (pure FSDP: a quarter each) and 2 variants: each
    process's bytes per variant (per peer) differ by at most one leaf's share; a leaf only some
    processes hold loads only theirs; a leaf goes by an allowed variant; one leaf is not split."""
    import random

    rng = random.Random(7)
    shares = [{p: rng.randrange(1, 1 << 20) // 4 * 4 for p in range(4)} for _ in range(40)]
    shares = [{p: share[0] for p in range(4)} for share in shares] + [{0: 5000}, {1: 3000, 3: 3000}]
    chosen = replica_plan.assign_variants(shares, [[0, 1]] * len(shares))
    assert chosen == replica_plan.assign_variants(shares, [[0, 1]] * len(shares))   # the same plan everywhere
    for p in range(4):
        per = [sum(s.get(p, 0) for s, v in zip(shares, chosen) if v == w) for w in (0, 1)]
        assert abs(per[0] - per[1]) <= max(s.get(p, 0) for s in shares) and min(per) > 0, (p, per)
    assert replica_plan.assign_variants(shares[:3], [[1], [0, 1], [1]]) == [1, 0, 1]   # 0, 2: only variant 1
    assert replica_plan.assign_variants([{p: 1 << 30 for p in range(4)}], [[0, 1]]) == [0]   # one giant leaf: whole


def test_by_place_sends_one_leaf_to_as_many_peers_as_a_process_has_places():
    """A leaf's device places take its variant and the allowed ones after it, cyclically: one giant
    leaf's regions on a process's 2 (or more) devices go to 2 peers; one place keeps the leaf whole."""
    assert replica_plan.by_place(1, [0, 1], 4) == (1, 0, 1, 0)
    assert replica_plan.by_place(0, [0, 1], 2) == (0, 1)
    assert replica_plan.by_place(2, [0, 2, 3], 4) == (2, 3, 0, 2)
    assert replica_plan.by_place(3, [0, 2, 3], 1) == (3,)
    assert replica_plan.by_place(1, [1], 8) == (1,) * 8
    with pytest.raises(ValueError):
        replica_plan.by_place(1, [0, 2], 2)   # a variant not allowed: a bug upstream, not a silent pick


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


def test_replica_variants_keep_the_rule_for_any_domains():
    """400 random jobs (2 to 12 processes; one domain, all distinct, hosts of unequal sizes; 1 to
    n - 1 replicas): every variant is ``replicas`` permutations keeping the rule (:func:`_spans`: no
    replica on its process, distinct holders; as many domains spanned as the base orders, the fewest
    and in all), the first variant is the base, and no two variants share a process's first holder."""
    import random

    rng = random.Random(5)
    for _ in range(400):
        n = rng.randrange(2, 13)
        kind = rng.randrange(4)
        domains = ((0,) * n if kind == 0 else tuple(range(n)) if kind == 1 else
                   tuple(sorted(rng.randrange(rng.randrange(1, n + 1)) for _ in range(n))) if kind == 2 else
                   tuple(rng.choice("abc") for _ in range(n)))
        replicas = rng.randrange(1, n)
        variants = replica_plan.replica_variants(domains, replicas)
        base = replica_plan.replica_orders(domains, replicas)
        assert list(variants[0]) == base and 1 <= len(variants) <= replica_plan.SPREAD
        least = _spans(domains, base)
        for orders in variants:
            assert len(orders) == replicas and all(sorted(o) == list(range(n)) for o in orders), (domains, orders)
            spans = _spans(domains, orders)
            assert min(spans) >= min(least) and sum(spans) >= sum(least), (domains, replicas, orders)
        for p in range(n):
            assert len({orders[0][p] for orders in variants}) == len(variants), (domains, variants)


def test_at_scale_a_lost_share_is_read_by_four_holders_and_parity_reads_one_kth_more():
    """benchmarks/tier_scale.py on the real planners (``leaf_plans``, ``parity_plan.transfers``): with
    replicas=1 a lost process's share is spread over the holders the failure-domain rule allows (2 for
    two hosts of two processes, 4 -- SPREAD -- from 16 processes on, even for one giant leaf), so the
    busiest holder reads 1.5 then 1.25 shares; with parity=k every survivor reads at most 1 + 1/k."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "tier_scale.py")
    spec = importlib.util.spec_from_file_location("tier_scale", path)
    scale = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(scale)
    for hosts, per_host, holders in ((2, 2, 2), (2, 8, 4), (32, 8, 4)):
        domains = [p // per_host for p in range(hosts * per_host)]
        for sizes in scale.states().values():
            found = scale.replicas(domains, 8, sizes)
            assert (found["holders"], found["read"]) == (holders, 1 + 1 / holders), (hosts, per_host, found)
        for k in (2, 3):
            assert scale.parity(domains, k)["read"] == pytest.approx(1 + 1 / k)
