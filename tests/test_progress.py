"""Progress reporting: absl INFO lines (rate-limited, one summary per operation), the terminal
line, ``Options(progress=False)``, the ``jax.monitoring`` events, and ``RestoreStats``."""

import io
import logging as std_logging
import re
import sys

import jax
import jax.monitoring
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dispatch_io as dio
from dispatch_io import progress as progress_lib
from dispatch_io.progress import EVENTS, Progress, size
from dispatch_io.progress import RestoreStats

MiB = 1 << 20
LINE = re.compile(r"dispatch_io: (\w+) (\S+): (?:(\w+) )?batch (\d+)/(\d+), (.+) / (.+) \((\d+)%\), (\S+ \w+/s|-)$")


@pytest.fixture
def absl_info(caplog):
    """The messages dispatch_io logs through absl at INFO, in order."""
    caplog.set_level(std_logging.INFO, logger="absl")
    return lambda: [r.getMessage() for r in caplog.records
                    if r.name == "absl" and r.levelno == std_logging.INFO and r.getMessage().startswith("dispatch_io: ")]


def make_tree(mesh):
    """~2.1 MiB in several leaves: several batches at a 1 MiB budget."""
    return {
        "w": jax.device_put(np.arange(256 * 1024, dtype=np.float32).reshape(512, 512), NamedSharding(mesh, P("data", "model"))),
        "v": np.arange(64 * 1024, dtype=np.float64),
        "rng": jax.random.key(3),
        "step": 5,
    }


STORED = 512 * 512 * 4 + 64 * 1024 * 8 + 8   # bytes of w, v and the key's key_data


class FakeTerminal(io.StringIO):
    def isatty(self):
        return True


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# ---- absl lines ------------------------------------------------------------------------------

def test_a_short_save_and_restore_log_one_summary_line_each(dispatcher_cls, mesh, tmp_path, absl_info, monkeypatch):
    monkeypatch.setattr(progress_lib, "LOG_EVERY_SECS", 60.0)  # longer than these take, however slow the machine
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=1 * MiB) as d:
        stats = d.save(path, make_tree(mesh)).wait(60)
        assert stats.batches > 2
        (saved,) = absl_info()
        assert saved == (f"dispatch_io: saved {path}: {size(stats.bytes_written)} in {stats.batches} batches, "
                         f"{stats.total_seconds:.2f} s ({progress_lib.rate(stats.bytes_written, stats.total_seconds)}), "
                         f"blocked {stats.blocked_seconds:.3f} s, peak host {size(stats.peak_host_bytes)}")
        assert "MiB/s" in saved or "KiB/s" in saved
        d.restore(path)
        r = d.last_restore_stats
        assert absl_info()[1:] == [f"dispatch_io: restored {path}: {size(r.bytes_read)} in {r.batches} batches, "
                                   f"{r.total_seconds:.2f} s ({progress_lib.rate(r.bytes_read, r.total_seconds)})"]


def test_a_long_save_logs_each_batch_with_bytes_and_rate(dispatcher_cls, mesh, tmp_path, absl_info, monkeypatch):
    monkeypatch.setattr(progress_lib, "LOG_EVERY_SECS", 0.0)  # every batch is "2 s later"
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=1 * MiB) as d:
        stats = d.save(path, make_tree(mesh)).wait(60)
    *periodic, summary = absl_info()
    assert summary.startswith(f"dispatch_io: saved {path}: ")
    parsed = [LINE.match(line) for line in periodic]
    assert all(parsed), periodic
    # One line per batch but the last (the summary follows it), counted in completion order.
    assert [int(m[4]) for m in parsed] == list(range(1, stats.batches))
    assert {(m[1], m[2], m[3], int(m[5]), m[7]) for m in parsed} == {
        ("save", str(path), None, stats.batches, size(stats.bytes_written))}
    done = [int(m[8]) for m in parsed]
    assert done == sorted(done) and 0 < done[0] and done[-1] < 100


def test_progress_lines_are_rate_limited_by_the_clock():
    clock = FakeClock()
    logged = []
    p = Progress("save", "ck", stream=io.StringIO(), clock=clock)
    p.phase("", 10, 10 * MiB)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(progress_lib.logging, "info", lambda fmt, *args: logged.append(fmt % args))
        for _ in range(9):
            clock.now += 0.5
            p.advance(MiB)
        p.advance(MiB)   # the last batch: no progress line, the summary comes next
        p.finish("dispatch_io: saved ck: done")
    assert logged == [  # at 2.0 s and 4.0 s after the start
        "dispatch_io: save ck: batch 4/10, 4.0 MiB / 10.0 MiB (40%), 2.0 MiB/s",
        "dispatch_io: save ck: batch 8/10, 8.0 MiB / 10.0 MiB (80%), 2.0 MiB/s",
        "dispatch_io: saved ck: done",
    ]
    assert p.phases[""].batches_done == 10 and p.phases[""].bytes_done == 10 * MiB


# ---- the terminal line -------------------------------------------------------------------------

def test_on_a_terminal_one_line_is_rewritten_and_ends_with_the_summary(dispatcher_cls, mesh, tmp_path,
                                                                         absl_info, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress_lib, "TTY_AFTER_SECS", 0.0)
    monkeypatch.setattr(progress_lib, "TTY_EVERY_SECS", 0.0)
    monkeypatch.setattr(progress_lib, "LOG_EVERY_SECS", 0.0)
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=1 * MiB) as d:
        stats = d.save(path, make_tree(mesh)).wait(60)
    text = terminal.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    *lines, last = text[1:].split("\r")
    assert [int(LINE.match(line.rstrip())[4]) for line in lines] == list(range(1, stats.batches))
    assert last.rstrip() == progress_lib.save_summary(stats)
    assert len(last) >= max(map(len, lines))   # padded over the longer line it replaces
    assert absl_info() == [progress_lib.save_summary(stats)]   # no periodic lines in the log


def test_short_operations_draw_nothing_on_a_terminal_and_failures_end_the_line():
    clock, terminal = FakeClock(), FakeTerminal()
    p = Progress("restore", "ck", stream=terminal, clock=clock)
    p.phase("read", 4, 4 * MiB)
    clock.now += 0.2
    p.advance(MiB)
    p.finish("dispatch_io: restored ck")
    assert terminal.getvalue() == ""   # under TTY_AFTER_SECS

    p = Progress("restore", "ck", stream=terminal, clock=clock)
    with pytest.raises(OSError):
        with p:
            p.phase("read", 4, 4 * MiB)
            clock.now += 1.0
            p.advance(MiB)
            raise OSError("disk gone")
    assert terminal.getvalue() == "\rdispatch_io: restore ck: read batch 1/4, 1.0 MiB / 4.0 MiB (25%), 1.0 MiB/s\n"


def test_progress_false_is_silent_but_keeps_stats_and_events(mesh, tmp_path, absl_info, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    for name in ("LOG_EVERY_SECS", "TTY_AFTER_SECS", "TTY_EVERY_SECS"):
        monkeypatch.setattr(progress_lib, name, 0.0)
    seen = []
    listener = lambda event, value, **kw: seen.append(event)  # noqa: E731
    jax.monitoring.register_scalar_listener(listener)
    try:
        with dio.LocalDispatcher(host_memory_budget=1 * MiB, progress=False) as d:
            stats = d.save(tmp_path / "ckpt", make_tree(mesh)).wait(60)
            d.restore(tmp_path / "ckpt")
    finally:
        jax.monitoring.unregister_scalar_listener(listener)
    assert absl_info() == [] and terminal.getvalue() == ""
    assert stats.bytes_written == STORED and d.last_restore_stats.bytes_read == STORED
    assert [e for e in seen if e.startswith("/dispatch_io/")] == [
        "/dispatch_io/save/bytes", "/dispatch_io/save/peak_host_bytes", "/dispatch_io/restore/bytes",
        "/dispatch_io/restore/broadcast_bytes", "/dispatch_io/restore/received_bytes",
        "/dispatch_io/restore/sent_bytes"]


# ---- jax.monitoring ----------------------------------------------------------------------------

class Events:
    """Every duration and scalar event recorded while registered: {name: [values]}."""

    def __enter__(self):
        self.seen: dict[str, list] = {}
        jax.monitoring.register_event_duration_secs_listener(self._record)
        jax.monitoring.register_scalar_listener(self._record)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._record)
        jax.monitoring.unregister_scalar_listener(self._record)

    def _record(self, event, value, **kwargs):
        if event.startswith("/dispatch_io/"):
            self.seen.setdefault(event, []).append(value)

    def of(self, kind: str) -> dict:
        return {name: values for name, values in self.seen.items() if name.startswith(f"/dispatch_io/{kind}/")}


def expected(kind: str, stats) -> dict:
    return {name: [getattr(stats, field)] for name, (_, field) in EVENTS.items()
            if name.startswith(f"/dispatch_io/{kind}/") and (field != "verify_seconds" or stats.verified)}


def test_monitoring_events_carry_the_stats_of_each_save_and_restore(dispatcher_cls, mesh, tmp_path):
    path = tmp_path / "ckpt"
    with Events() as events, dispatcher_cls(host_memory_budget=1 * MiB, checksums=True) as d:
        stats = d.save(path, make_tree(mesh)).wait(60)
        assert events.of("save") == expected("save", stats)
        assert len(events.of("save")) == 8 and events.of("restore") == {}

        d.restore(path, verify=True)
        verified = d.last_restore_stats
        assert events.of("restore") == expected("restore", verified)
        assert "/dispatch_io/restore/verify_duration_secs" in events.of("restore")

        d.restore(path, partial=True, target={"v": np.zeros(64 * 1024)})
        plain = d.last_restore_stats
        assert {name: values[1:] for name, values in events.of("restore").items() if values[1:]} == \
            expected("restore", plain)   # no verify_duration_secs for a restore that did not verify

        checked = d.verify(path)
        assert events.of("verify") == expected("verify", checked) == {
            "/dispatch_io/verify/total_duration_secs": [checked.total_seconds],
            "/dispatch_io/verify/bytes": [STORED]}
    assert stats.bytes_written == STORED and 0 < stats.blocked_seconds <= stats.total_seconds
    assert 0 < stats.peak_host_bytes <= 1 * MiB
    assert all(v > 0 for v in (stats.plan_seconds, stats.transfer_seconds, stats.write_seconds, stats.commit_seconds))


def test_a_listener_that_raises_fails_neither_save_nor_restore(mesh, tmp_path, caplog):
    def broken(event, value, **kwargs):
        if event.startswith("/dispatch_io/"):
            raise RuntimeError("metrics backend down")

    jax.monitoring.register_event_duration_secs_listener(broken)
    try:
        with dio.LocalDispatcher(host_memory_budget=1 * MiB) as d:
            d.save(tmp_path / "ckpt", make_tree(mesh)).wait(60)
            restored = d.restore(tmp_path / "ckpt")
    finally:
        jax.monitoring.unregister_event_duration_listener(broken)
    np.testing.assert_array_equal(restored["v"], np.arange(64 * 1024, dtype=np.float64))
    assert any("jax.monitoring listener raised" in r.getMessage() for r in caplog.records)


def test_the_event_table_in_the_module_doc_lists_every_event():
    documented = set(re.findall(r"^\s+(/dispatch_io/\S+)\s+(duration|scalar)\s+\w+Stats\.(\w+)",
                                progress_lib.__doc__, re.M))
    assert documented == {(name, how, field) for name, (how, field) in EVENTS.items()}


# ---- RestoreStats and Dispatcher.verify --------------------------------------------------------

def test_restore_stats_count_what_was_read(dispatcher_cls, mesh, tmp_path):
    path = tmp_path / "ckpt"
    with dispatcher_cls(host_memory_budget=1 * MiB, checksums=True) as d:
        assert d.last_restore_stats is None
        d.save(path, make_tree(mesh)).wait(60)
        d.restore(path)
        full = d.last_restore_stats
        assert isinstance(full, RestoreStats) and full.path == str(path)
        assert full.bytes_read == STORED and full.batches >= 3 and not full.verified and full.verify_seconds >= 0
        assert full.plan_seconds > 0 and full.read_seconds > 0
        assert full.total_seconds >= full.plan_seconds + full.verify_seconds + full.read_seconds

        d.restore(path, verify=True)   # whole chunks checked, then the regions read
        assert d.last_restore_stats.verified and d.last_restore_stats.bytes_read == 2 * STORED
        assert d.last_restore_stats.verify_seconds > 0

        d.restore(path, {"w": jax.ShapeDtypeStruct((512, 512), np.float32, sharding=NamedSharding(mesh, P("data")))},
                  partial=True)
        assert d.last_restore_stats.bytes_read == 512 * 512 * 4   # replicas read once

        with pytest.raises(dio.TreeMismatchError):
            d.restore(path, {"nope": np.zeros(3)}, partial=True)
        assert d.last_restore_stats.bytes_read == 512 * 512 * 4   # a failed restore leaves it


def test_verify_reads_every_chunk_within_the_budget_and_finds_corruption(dispatcher_cls, mesh, tmp_path):
    import storage_helpers as sh

    tree = make_tree(mesh)
    with dispatcher_cls(host_memory_budget=1 * MiB) as d:
        d.save(tmp_path / "plain", tree).wait(60)
        plain = d.verify(tmp_path / "plain")
        assert plain.bytes_read == STORED and not plain.verified and plain.read_seconds == 0
        assert plain.batches >= STORED // (MiB // 2)   # half-budget batches

    with dispatcher_cls(host_memory_budget=1 * MiB, checksums=True) as d:
        d.save(tmp_path / "summed", tree).wait(60)
        assert d.verify(tmp_path / "summed").verified
        sh.flip_byte(next(iter(sh.chunks(tmp_path / "summed", "['v']").values())))
        with pytest.raises(dio.CorruptCheckpointError) as info:
            d.verify(tmp_path / "summed")
        assert info.value.keypath == "['v']"
        with pytest.raises(FileNotFoundError):
            d.verify(tmp_path / "missing")
