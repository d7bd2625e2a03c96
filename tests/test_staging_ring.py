"""The staging ring (``dispatch_io.save.staging.StagingRing``): batches of any size up to its capacity
fit, slices never overlap or leave its bounds, releases may come in any order, and threads
holding slices at once never share a byte. Pure data structure tests: no IO, no devices.
"""

import random
import threading
import time

import numpy as np
import pytest

from dispatch_io.save.staging import StagingRing

TIMEOUT = 30


def offset(view: np.ndarray) -> int:
    return view.__array_interface__["data"][0] - view.base.__array_interface__["data"][0]


def try_acquire(ring: StagingRing, n: int):
    """(ticket, offset), or (None, None) when ``n`` bytes do not fit now (never blocks)."""
    ticket, view = ring.acquire(n, cancelled=lambda: True)
    if ticket is None:
        return None, None
    assert view.size == n
    return ticket, offset(view)


def test_staging_ring_exact_fits_wrap_and_out_of_order_release():
    ring = StagingRing(100)
    whole, at = try_acquire(ring, 100)                  # a batch exactly the capacity
    assert at == 0 and try_acquire(ring, 1) == (None, None)
    ring.release(whole)

    a, at_a = try_acquire(ring, 40)
    b, at_b = try_acquire(ring, 60)                     # ends exactly at the capacity
    assert (at_a, at_b) == (0, 40) and try_acquire(ring, 1) == (None, None)
    ring.release(a)
    c, at_c = try_acquire(ring, 40)                     # wraps: exactly the freed front
    assert at_c == 0 and try_acquire(ring, 1) == (None, None)
    ring.release(b)
    ring.release(c)

    ring = StagingRing(100)
    a, _ = try_acquire(ring, 30)
    b, _ = try_acquire(ring, 30)
    c, at_c = try_acquire(ring, 30)
    assert at_c == 60
    ring.release(b)                                     # out of order: a still holds the front
    assert try_acquire(ring, 30) == (None, None)
    assert ring.in_use == 60
    ring.release(a)                                     # a and b come back together
    d, at_d = try_acquire(ring, 30)                     # [90, 100) is too small: wraps to 0
    e, at_e = try_acquire(ring, 30)                     # wrapped: fills up to c exactly
    assert (at_d, at_e) == (0, 30)
    assert try_acquire(ring, 1) == (None, None)         # [60, 90) live, [90, 100) behind head
    for t in (c, d, e):
        ring.release(t)
    assert ring.in_use == 0 and try_acquire(ring, 100)[1] == 0


@pytest.mark.parametrize("size", [0, -1, 101])
def test_staging_ring_rejects_impossible_sizes(size):
    with pytest.raises(ValueError):
        StagingRing(100).acquire(size)


@pytest.mark.parametrize("capacity", [64, 100, 4096])
def test_staging_ring_random_model(capacity):
    """Random acquires and out-of-order releases: slices never overlap, stay in bounds, and an
    empty ring always fits a batch of any size up to the capacity."""
    rng = random.Random(capacity)
    ring = StagingRing(capacity)
    live: dict[int, tuple[int, int]] = {}
    fits = 0
    for _ in range(4000):
        if live and rng.random() < 0.45:
            ticket = rng.choice(list(live))
            ring.release(ticket)
            del live[ticket]
            continue
        n = rng.choice([rng.randint(1, max(1, capacity // 4)), rng.randint(1, capacity)])
        ticket, at = try_acquire(ring, n)
        if ticket is None:
            assert live, f"an empty ring refused {n} of {capacity} bytes"
            continue
        fits += 1
        assert 0 <= at and at + n <= capacity
        for start, end in live.values():
            assert at + n <= start or end <= at, f"[{at}, {at + n}) overlaps live [{start}, {end})"
        live[ticket] = (at, at + n)
        assert ring.in_use == sum(end - start for start, end in live.values())
    assert fits > 1000


def test_staging_ring_threads_never_share_bytes():
    """Writers fill their slice with their own byte, hold it a moment, and find it unchanged."""
    ring = StagingRing(4096)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        for i in range(150):
            n = rng.randint(1, 2048)
            ticket, view = ring.acquire(n)
            mark = (seed * 37 + i) % 251
            view[:] = mark
            time.sleep(rng.random() * 1e-4)
            if not (view == mark).all():
                errors.append((seed, i))
            ring.release(ticket)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "staging ring deadlocked"
    assert errors == [] and ring.in_use == 0
