"""Test set-up: 8 simulated CPU devices (set before jax is imported) and shared helpers."""

import concurrent.futures
import errno
import os
import types

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import dispatch_io as dio  # noqa: E402


def host_bytes(x) -> bytes:
    """The exact bytes of a leaf (PRNG keys: their key_data), gathered to host."""
    if dio.tree.is_prng_key(x):
        x = jax.random.key_data(x)
    return np.ascontiguousarray(np.asarray(jax.device_get(x))).tobytes()


def assert_trees_bit_equal(a, b):
    """Same structure, same key paths, and byte-identical leaves (dtype and shape included)."""
    fa, ta = jax.tree_util.tree_flatten_with_path(a)
    fb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb, f"structure differs:\n{ta}\n{tb}"
    for (pa, xa), (pb, xb) in zip(fa, fb):
        key = jax.tree_util.keystr(pa)
        assert pa == pb, key
        if isinstance(xa, (bool, int, float, complex, str)):
            assert type(xa) is type(xb) and (xa == xb or (xa != xa and xb != xb)), key
            continue
        ka, kb = dio.tree.is_prng_key(xa), dio.tree.is_prng_key(xb)
        assert ka == kb, key
        if ka:
            assert jax.random.key_impl(xa) == jax.random.key_impl(xb), key
            xa, xb = jax.random.key_data(xa), jax.random.key_data(xb)
        assert tuple(xa.shape) == tuple(xb.shape), key
        assert np.dtype(xa.dtype) == np.dtype(xb.dtype), key
        assert host_bytes(xa) == host_bytes(xb), f"{key}: bytes differ"


class FakeClock:
    """A clock for policies and managers (``clock=``) that moves only when a test sets ``now``."""

    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture(scope="session")
def mesh():
    assert jax.device_count() == 8, "conftest must set XLA_FLAGS before jax is imported"
    return jax.make_mesh((4, 2), ("data", "model"))


DISPATCHERS = [dio.LocalDispatcher, dio.ColocatedDispatcher]
DISPATCHER_IDS = ["local", "colocated"]


@pytest.fixture(params=DISPATCHERS, ids=DISPATCHER_IDS)
def dispatcher_cls(request):
    """Each dispatcher class with the same API: the behaviour tests run against both."""
    return request.param


RUNNERS = {dio.LocalDispatcher: dio.LocalRunner, dio.ColocatedDispatcher: dio.ColocatedRunner}


class HookedRunner:
    """A dispatcher's runner with hooks on its IO: ``write_hook(regions)`` runs before every
    batch write and ``read_hook(items)`` before every batch read, on an IO thread of their own --
    raise to fail the call (as a failing worker would), block to delay it. A hook set to None
    heals it. Everything else is the real runner's."""

    def __init__(self, runner, write_hook=None, read_hook=None):
        self.runner, self.write_hook, self.read_hook = runner, write_hook, read_hook
        self._pool = concurrent.futures.ThreadPoolExecutor(8, initializer=runner.threads.mark)

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def _hooked(self, call, hook_name):
        def hooked(batch, *rest):
            hook = getattr(self, hook_name)

            def run():
                if hook is not None:
                    hook(batch)
                return call(batch, *rest).result()
            return self._pool.submit(run)
        return hooked

    def open_writer(self, target):
        writer = self.runner.open_writer(target)
        return types.SimpleNamespace(write=self._hooked(writer.write, "write_hook"), close=writer.close)

    def open_reader(self, kvstore, context):
        reader = self.runner.open_reader(kvstore, context)
        return types.SimpleNamespace(read=self._hooked(reader.read, "read_hook"), checksums=reader.checksums,
                                     close=reader.close)

    def close(self):
        self.runner.close()
        self._pool.shutdown(wait=True)


def hooked_dispatcher(dispatcher_cls, write_hook=None, read_hook=None, host_memory_budget: int = 1 << 30,
                      **options) -> dio.Dispatcher:
    """A dispatcher like ``dispatcher_cls(host_memory_budget, **options)`` whose runner is a
    :class:`HookedRunner` (``d.runner.write_hook = ...`` changes a hook)."""
    options = dio.Options(host_memory_budget=host_memory_budget, **options)
    local = dispatcher_cls is dio.LocalDispatcher
    runner = RUNNERS[dispatcher_cls](options.io_settings(), **(
        {"transfer": dio.transfer.resolve(options.host_transfer)} if local else {}))
    return dio.Dispatcher(options, HookedRunner(runner, write_hook, read_hook))


def fail_batches_of(victim, error=lambda: OSError(errno.ENOSPC, "No space left on device")):
    """A write hook failing every batch holding the leaf ``victim`` (every batch: None) with ``error()``."""
    def hook(regions):
        if victim is None or any(r.keypath == victim for r in regions):
            raise error()
    return hook


@pytest.fixture
def dispatcher(dispatcher_cls):
    d = dispatcher_cls(host_memory_budget=1 << 20)
    yield d
    d.close()


LAYOUTS = ["ocdbt", "files"]


@pytest.fixture(params=LAYOUTS)
def layout(request):
    """Each chunk layout (``Options.layout``): behaviour that must hold for both runs with both."""
    return request.param


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on loopback for the whole session, with bucket ``ckpts``; TensorStore
    (through dispatch_io's ``s3://`` paths) is pointed at it by the usual AWS variables."""
    from s3_server import MotoServer, s3_environment

    server = MotoServer()
    saved = dict(os.environ)
    os.environ.update(s3_environment(server.endpoint))
    try:
        server.create_bucket("ckpts")
        yield server
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.stop()


@pytest.fixture
def s3_prefix(s3_server, request):
    """A fresh ``s3://ckpts/<test>-<id>`` prefix."""
    import uuid
    return f"s3://ckpts/{request.node.name.replace('[', '-').rstrip(']')}-{uuid.uuid4().hex[:6]}"
