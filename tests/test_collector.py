"""The garbage collector paused while a save is planned or a restore runs (``dispatch_io.collector``).

A restore of thousands of leaves creates objects that all stay alive; every full collection it
would trigger walks the whole heap and frees nothing."""

import gc
import threading

import jax
import numpy as np
import pytest

import dispatch_io as dio
from conftest import assert_trees_bit_equal
from dispatch_io.collector import CollectorPause


@pytest.fixture
def collections():
    """A list that gets one entry per collection the collector starts (any thread)."""
    seen = []

    def callback(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(callback)
    yield seen
    gc.callbacks.remove(callback)


def many_leaves(n=3000):
    return {f"l{i:04d}": np.full((i % 7 + 1,), i, np.float32) for i in range(n)}


def test_a_restore_of_many_leaves_runs_no_collection_and_leaves_the_collector_on(tmp_path, collections):
    tree = many_leaves()
    with dio.LocalDispatcher(host_memory_budget=8 << 20, progress=False) as d:
        d.save(tmp_path / "ckpt", tree).wait()
        target = jax.tree.map(np.zeros_like, tree)
        gc.collect()
        del collections[:]
        out = d.restore(tmp_path / "ckpt", target)
        during = list(collections)
        assert gc.isenabled()
        assert_trees_bit_equal(out, tree)
        assert len(during) <= 1 and 2 not in during, during   # at most the young one due as it resumes
        # the same work with the collector running collects (else this test could not fail)
        del collections[:]
        objects = [[i, {"x": (i,)}] for i in range(len(tree) * 40)]
        assert collections, "the allocations above should have started a collection"
        del objects


def test_a_collector_disabled_by_the_program_stays_disabled(tmp_path):
    tree = many_leaves(50)
    with dio.LocalDispatcher(host_memory_budget=8 << 20, progress=False) as d:
        gc.disable()
        try:
            d.save(tmp_path / "ckpt", tree).wait()
            d.restore(tmp_path / "ckpt")
            assert not gc.isenabled()
        finally:
            gc.enable()


def test_pauses_nest_across_threads_and_resume_when_the_last_ends():
    pause = CollectorPause()
    inside, release = threading.Event(), threading.Event()

    def other():
        with pause():
            inside.set()
            release.wait(10)

    thread = threading.Thread(target=other)
    with pause():
        assert not gc.isenabled()
        thread.start()
        assert inside.wait(10)
    assert not gc.isenabled()   # the other thread's pause still holds
    release.set()
    thread.join(10)
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with pause():
            raise ValueError("the body's error passes through")
    assert gc.isenabled()
