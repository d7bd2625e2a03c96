"""A multi-process restore where one process's data read stalls finishes on every process, soon
and bit-exact: that process hedges the read (workers/hedged.py) instead of holding the others at
the next barrier. Two processes restore from S3 (moto) through the fault proxy (tests/servers/fault_proxy.py)."""

from fault_proxy import Fault, SlowProxy
from test_multiprocess import assert_restored, deadline, jobs  # noqa: F401  (jobs: the fixture)


def test_a_job_where_one_process_read_stalls_finishes_on_every_process(jobs, s3_prefix, s3_server):  # noqa: F811
    path = f"{s3_prefix}/ckpt"
    saved = jobs("save_big", path, 2, 4)
    saved.wait(deadline())
    proxy = SlowProxy(s3_server.port)
    try:
        env = {"AWS_ENDPOINT_URL_S3": proxy.endpoint}
        healthy = jobs("restore_big", path, 2, 4, env=env)
        healthy_results = healthy.wait(deadline())
        assert_restored(healthy_results, healthy)
        # The default deadline (20 s) would end the stall too, but only after the bound below.
        stall = proxy.add(Fault("stall", "GET", "/d/", min_bytes=32 << 10))
        slowed = jobs("restore_big", path, 2, 4, env=env)
        results = slowed.wait(deadline())
        assert_restored(results, slowed)                     # every process, every shard bit-exact
    finally:
        proxy.stop()
    assert len(stall.hit) == 1, stall.hit
    baseline = max(r["seconds"] for r in healthy_results)
    assert max(r["seconds"] for r in results) <= max(20.0, 5 * baseline), (results, baseline)
    assert max(r["seconds"] for r in results) < 19.0, results     # before the 20 s deadline: a hedge ended it
