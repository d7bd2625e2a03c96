"""The coordination rooms every multi-process operation talks through (``multihost.coordination``),
on an in-memory stand-in for JAX's coordination service client: here, that a gather names the
processes it still waits for long before its timeout does (a straggler holds every other process
at the next gather; the log and a jax.monitoring event say which one)."""

import threading
import time

import jax
import pytest
from absl import logging as absl_logging

from dispatch_io.errors import BarrierTimeoutError
from dispatch_io.multihost import coordination
from dispatch_io.multihost.coordination import STRAGGLER_EVENT, Room


class MemoryService:
    """The key-value part of the coordination service client that a gather uses, in memory."""

    def __init__(self):
        self.values, self.cond = {}, threading.Condition()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.cond:
            if not allow_overwrite and key in self.values:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.values[key] = value
            self.cond.notify_all()

    def key_value_try_get(self, key):
        with self.cond:
            if key not in self.values:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.values[key]

    def blocking_key_value_get(self, key, timeout_in_ms):
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
            return self.values[key]

    def key_value_increment(self, key, by):
        with self.cond:
            self.values[key] = str(int(self.values.get(key, "0")) + by)
            return int(self.values[key])

    def key_value_dir_get(self, directory):
        with self.cond:
            return [(k, v) for k, v in self.values.items() if k.startswith(directory)]


@pytest.fixture
def stragglers(monkeypatch):
    """The straggler reports (absl warnings and jax.monitoring durations) made while the test runs."""
    seen = {"logged": [], "recorded": []}
    monkeypatch.setattr(coordination, "first_straggler_report", lambda timeout: 0.3)
    real_warning = absl_logging.warning
    monkeypatch.setattr(coordination.logging, "warning",
                        lambda msg, *args: (seen["logged"].append(msg % args), real_warning(msg, *args)))
    listener = lambda event, duration, **kw: seen["recorded"].append((event, duration))  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


def test_a_gather_names_the_process_it_waits_for_before_its_timeout(stragglers):
    """Process 0 of 3 gathers; process 2 publishes at once, process 1 only after 1.2 s: process 0
    names [1] (and only it) after the first report delay, again as the wait doubles, then gets
    every value -- no timeout, nothing raised."""
    service = MemoryService()
    rooms = [Room(service, p, 3, 30.0, "save", "gs://b/ckpt", "the save to gs://b/ckpt") for p in range(3)]

    def publish(p, delay):
        time.sleep(delay)
        rooms[p].set(f"sizes/{p}", p * 10)
        rooms[p].gather("sizes", together=False)

    others = [threading.Thread(target=publish, args=(p, d)) for p, d in ((1, 1.2), (2, 0.0))]
    for t in others:
        t.start()
    rooms[0].set("sizes/0", 0)
    got = rooms[0].gather("sizes", together=False)
    for t in others:
        t.join(10)
    assert got == {0: 0, 1: 10, 2: 20}
    mine = [line for line in stragglers["logged"] if line.startswith("dispatch_io: process 0 ")]
    assert len(mine) >= 2 and all("process(es) [1] to reach 'sizes' of the save to gs://b/ckpt" in m for m in mine), mine
    waits = [d for e, d in stragglers["recorded"] if e == STRAGGLER_EVENT]
    assert len(waits) >= 2 and 0.3 <= waits[0] < waits[1] < 1.5, waits


def test_a_straggler_never_coming_is_named_then_times_out(stragglers):
    """A process that never publishes is named while process 0 waits, then in its timeout."""
    rooms = [Room(MemoryService(), 0, 2, 1.0, "restore", "s3://b/x", "the restore of s3://b/x")]
    rooms[0].set("plan/0", 1)
    with pytest.raises(BarrierTimeoutError, match=r"process\(es\) \[1\]") as info:
        rooms[0].gather("plan", together=False)
    assert info.value.processes == [1]
    assert any("waited" in m and "process(es) [1]" in m for m in stragglers["logged"]), stragglers["logged"]


def test_the_first_report_comes_well_before_the_timeout():
    assert coordination.first_straggler_report(300.0) == 30.0
    assert coordination.first_straggler_report(3000.0) == 60.0
    assert coordination.first_straggler_report(20.0) == 5.0
    assert coordination.first_straggler_report(3.0) == 3.0
