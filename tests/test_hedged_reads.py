"""Hedged reads without IO (workers/hedged.py): when a read is hedged (pure), and how the waiter
picks the first answer, keeps a read alive while one attempt is left, and stays within its
bounds -- with futures of our own standing in for TensorStore's."""

import threading
import time

import pytest

import dispatch_io as dio
from dispatch_io.workers import deadlines
from dispatch_io.workers.hedged import MAX_HEDGES, SLOWER, HedgedOpen, Hedger, HedgePolicy

KiB = 1 << 10
POLICY = HedgePolicy(after=0.2, min_rate=64 * KiB)


def test_before_peers_finish_only_the_floor_and_min_rate_count():
    assert POLICY.deadline(64 * KiB, []) == pytest.approx(0.2 + 1.0)
    assert POLICY.deadline(64 * KiB, [(64 * KiB, 0.01)]) == pytest.approx(1.2)   # one sample is not enough


def test_peers_predict_the_deadline_within_the_floor_and_the_cap():
    peers = [(100 * KiB, 0.05), (100 * KiB, 0.1)]           # 200 KiB in 0.1 s, fastest 0.05 s
    predicted = 0.05 + 300 * KiB / (200 * KiB / 0.1)
    assert POLICY.deadline(300 * KiB, peers) == pytest.approx(SLOWER * predicted)
    fast_peers = [(100 * KiB, 0.01), (100 * KiB, 0.02)]
    assert POLICY.deadline(1, fast_peers) == 0.2                                   # never under the floor
    slow_peers = [(KiB, 100.0), (KiB, 200.0)]
    assert POLICY.deadline(64 * KiB, slow_peers) == pytest.approx(1.2)           # never past the min rate


class FakeRead:
    """A TensorStore-like future: ends when the test says, with a value or an error."""

    def __init__(self):
        self.callbacks, self.value, self.error = [], None, None
        self.is_done = self.was_cancelled = False
        self.lock, self.ended = threading.Lock(), threading.Event()

    def add_done_callback(self, callback):
        with self.lock:
            if not self.is_done:
                self.callbacks.append(callback)
                return
        callback(self)

    def force(self):
        pass

    def finish(self, value=None, error=None):
        with self.lock:
            self.value, self.error, self.is_done = value, error, True
            callbacks, self.callbacks = self.callbacks, []
        self.ended.set()
        for callback in callbacks:
            callback(self)

    def result(self):
        self.ended.wait()   # blocks, as TensorStore's
        if self.error:
            raise self.error
        return self.value

    def exception(self):
        return self.error

    def cancelled(self):
        return self.was_cancelled

    def cancel(self):
        self.was_cancelled = True


def run_waiter(hedger, futures, sizes, reissue):
    out = {}
    thread = threading.Thread(target=lambda: out.update(result=hedger.wait_all(futures, sizes, reissue)))
    thread.start()
    return thread, out


def test_a_stalled_read_is_hedged_and_the_first_answer_wins():
    reads = [FakeRead() for _ in range(4)]
    hedges = {}

    def reissue(companion, i):
        hedges[i] = FakeRead()
        hedges[i].finish(value=f"hedge {i}")
        return hedges[i]

    hedger = Hedger(POLICY, lambda: "companion", window=1 << 20)
    thread, out = run_waiter(hedger, reads, [KiB] * 4, reissue)
    for i in (0, 1, 3):
        reads[i].finish(value=f"read {i}")
    thread.join(10)
    results, errors = out["result"]
    assert results == ["read 0", "read 1", "hedge 2", "read 3"] and errors == [None] * 4
    assert list(hedges) == [2] and reads[2].was_cancelled
    assert (hedger.stats.hedged, hedger.stats.won, hedger.stats.bytes) == (1, 1, KiB)


def test_a_read_fails_only_once_every_attempt_failed():
    reads = [FakeRead(), FakeRead(), FakeRead()]
    hedge = FakeRead()
    hedger = Hedger(POLICY, lambda: "companion", window=1 << 20)
    thread, out = run_waiter(hedger, reads, [KiB] * 3, lambda companion, i: hedge)
    reads[0].finish(value="a")
    reads[1].finish(value="b")
    deadline = time.monotonic() + 10
    while not hedger.stats.hedged and time.monotonic() < deadline:
        time.sleep(0.01)
    reads[2].finish(error=ValueError("primary gave up"))     # the hedge is still in flight
    time.sleep(0.2)
    assert thread.is_alive()
    hedge.finish(error=ValueError("hedge gave up too"))
    thread.join(10)
    results, errors = out["result"]
    assert results[:2] == ["a", "b"] and str(errors[2]) == "hedge gave up too"


def test_hedges_in_flight_are_bounded_by_count_and_bytes():
    reads = [FakeRead() for _ in range(6)]
    issued, hedges = [], []

    def reissue(companion, i):
        issued.append(i)
        hedges.append(FakeRead())   # answers only once the test is done
        return hedges[-1]

    hedger = Hedger(POLICY, lambda: "companion", window=4 * KiB)   # hedged bytes in flight <= 2 KiB
    thread, out = run_waiter(hedger, reads, [KiB, KiB, 3 * KiB, KiB, KiB, KiB], reissue)
    reads[0].finish(value=0)
    reads[1].finish(value=1)
    time.sleep(3)
    assert issued == [3, 4] and MAX_HEDGES == 2, issued     # read 2 (3 KiB) alone passes 2 KiB
    for i in range(2, 6):
        reads[i].finish(value=i)
    thread.join(10)
    assert out["result"][0] == list(range(6))
    for hedge in hedges:
        hedge.finish(value="late")


def test_a_slow_open_is_opened_again_and_the_first_open_wins():
    slow, fast = FakeRead(), FakeRead()
    opened = HedgedOpen(slow, lambda: fast, after=0.1)
    fast.finish(value="companion's array")
    assert opened.result() == "companion's array" and slow.was_cancelled


def test_deadline_options_are_checked():
    """Each bad value is refused naming its option -- an infinite timeout too, which
    ``deadlines.configure`` (run when a dispatcher is made) could not turn into whole seconds."""
    deadlines.check(None, 1)
    for timeout, rate, name in ((0, 1, "request_timeout"), (-1, 1, "request_timeout"), (True, 1, "request_timeout"),
                                (float("inf"), 1, "request_timeout"), (float("nan"), 1, "request_timeout"),
                                (1, 0, "min_request_rate"), (1, 1.5, "min_request_rate"),
                                (1, True, "min_request_rate")):
        with pytest.raises(ValueError, match=f"^{name} "):
            deadlines.check(timeout, rate)
    for bad in (0, -1.0, True, float("nan"), "1"):
        with pytest.raises(ValueError, match="^hedge_after "):
            dio.Options(hedge_after=bad)
    with pytest.raises(ValueError, match="^hedge_reads "):
        dio.Options(hedge_reads=1)
    with pytest.raises(ValueError, match="^request_timeout "):
        dio.Options(request_timeout=float("inf"))


def test_an_open_that_fails_before_its_deadline_fails_without_a_hedge():
    failing = FakeRead()
    failing.finish(error=ValueError("no such array"))
    opened = HedgedOpen(failing, lambda: pytest.fail("an open that failed was hedged"), after=5)
    assert str(opened.exception()) == "no such array"
    with pytest.raises(ValueError, match="no such array"):
        opened.result()
