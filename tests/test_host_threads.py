"""IO thread counts are sized from the CPUs this process may use, and stay overridable."""

import os

import pytest
import tensorstore as ts

import dispatch_io as dio
from dispatch_io.workers import IOSettings, Session, default_io_concurrency, default_threads, host_cpus


def test_defaults_scale_with_the_cpus():
    assert [default_threads(n) for n in (1, 2, 4, 16, 64)] == [2, 2, 2, 8, 16]
    assert [default_io_concurrency(n) for n in (1, 2, 8, 16, 64)] == [16, 16, 16, 32, 128]


def test_options_follow_this_processes_affinity_mask():
    """Restricting the (calling thread's) affinity to one CPU changes what Options() derives."""
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert host_cpus() == 1
        one = dio.Options()
        assert (one.write_threads, one.io_concurrency, one.copy_concurrency) == (2, 16, 1)
    finally:
        os.sched_setaffinity(0, before)
    everything = dio.Options()
    assert everything.write_threads == default_threads(len(before))
    assert everything.copy_concurrency == len(before)


def test_explicit_counts_win_and_reach_the_tensorstore_context(tmp_path):
    options = dio.Options(write_threads=5, io_concurrency=3, copy_concurrency=7)
    settings = options.io_settings()
    assert (settings.threads, settings.io_concurrency, settings.copy_concurrency) == (5, 3, 7)
    session = Session({"driver": "file", "path": str(tmp_path)}, settings)
    spec = session.context.spec.to_json()
    assert spec["file_io_concurrency"] == {"limit": 3} and spec["data_copy_concurrency"] == {"limit": 7}
    with dio.LocalDispatcher(1 << 20, write_threads=5) as d:
        assert d.runner.threads.pool._max_workers == 5


@pytest.mark.parametrize("name", ["write_threads", "io_concurrency", "copy_concurrency"])
def test_a_bad_count_names_the_option(name):
    with pytest.raises(ValueError, match=name):
        dio.Options(**{name: 0})
    field = name.replace("write_threads", "threads")
    with pytest.raises(ValueError, match=field):
        IOSettings(**{field: 1.5})
