"""Test set-up: 8 simulated CPU devices (set before jax is imported) and shared helpers."""

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
import types

os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f
) + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
JOBS = os.path.join(TESTS, "jobs")          # scripts run as the processes of a job
# The folders whose modules tests import by name (``import storage_helpers``, ``from s3_server import ...``):
# jobs/, servers/ (real object stores on loopback) and helpers/. Children get them on PYTHONPATH.
SUPPORT = [JOBS, os.path.join(TESTS, "servers"), os.path.join(TESTS, "helpers")]
sys.path[:0] = [folder for folder in SUPPORT if folder not in sys.path]

import dispatch_io as dio  # noqa: E402
from dispatch_io.manager.tiers.placement import as_regions  # noqa: E402
from s3_server import free_port  # noqa: E402  (one definition, for jobs and servers)


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


def put(mesh, value, *spec):
    """``value`` on ``mesh`` with ``PartitionSpec(*spec)``."""
    return jax.device_put(value, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def random_array(seed, shape, dtype=np.float32):
    """A deterministic array: normal floats, or ints in [-2^30, 2^30)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return rng.integers(-2**30, 2**30, size=shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


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
    try:
        with environment(s3_environment(server.endpoint)):
            server.create_bucket("ckpts")
            yield server
    finally:
        server.stop()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """``os.environ`` with ``values`` set, as it was again afterwards."""
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def fresh_prefix(scheme: str, request) -> str:
    """A fresh ``<scheme>://ckpts/<test>-<id>`` prefix."""
    import uuid
    return f"{scheme}://ckpts/{request.node.name.replace('[', '-').rstrip(']')}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def s3_prefix(s3_server, request):
    """A fresh ``s3://ckpts/<test>-<id>`` prefix."""
    return fresh_prefix("s3", request)


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS server on loopback for the whole session, with bucket ``ckpts``: fake-gcs-server behind
    our precondition layer (``tests/servers/gcs_server.py`` says why). TensorStore (through dispatch_io's
    ``gs://`` paths) is pointed at the layer; the emulator itself is ``.emulator``."""
    from gcs_server import FakeGcsServer, GcsPreconditions, gcs_environment

    emulator = FakeGcsServer()
    layer = GcsPreconditions(emulator.port)
    layer.emulator = emulator
    try:
        with environment(gcs_environment(layer.endpoint)):
            emulator.create_bucket("ckpts")
            yield layer
    finally:
        layer.stop()
        emulator.stop()


@pytest.fixture
def gcs_prefix(gcs_server, request):
    """A fresh ``gs://ckpts/<test>-<id>`` prefix."""
    return fresh_prefix("gs", request)


@dataclasses.dataclass(frozen=True)
class ObjectStore:
    """An object store the tests run against: its URL scheme, the port of its server (what a
    ``FaultyProxy`` forwards to), the variable that points TensorStore at an endpoint and the
    HTTP method of an object upload."""

    scheme: str
    port: int
    endpoint_variable: str
    upload_method: str


@pytest.fixture(params=["s3", "gcs"])
def object_store(request) -> ObjectStore:
    """Each object store (moto's S3, fake-gcs-server's GCS): tests that must hold on both."""
    if request.param == "s3":
        return ObjectStore("s3", request.getfixturevalue("s3_server").port, "AWS_ENDPOINT_URL_S3", "PUT")
    return ObjectStore("gs", request.getfixturevalue("gcs_server").port, "TENSORSTORE_GCS_HTTP_URL", "POST")


@pytest.fixture
def store_prefix(object_store, request):
    """A fresh prefix on each object store (``s3://ckpts/...``, ``gs://ckpts/...``)."""
    return fresh_prefix(object_store.scheme, request)


def crafted_safetensors(folder, header: dict, data: bytes = b"", name: str = "model.safetensors",
                        size: int | None = None):
    """Write ``folder/name``, a safetensors file holding ``header`` (as given, unchecked; padded to
    8 bytes) and ``data``; ``size`` claims another header length. Returns ``folder``."""
    os.makedirs(folder, exist_ok=True)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(folder, name), "wb") as f:
        f.write((len(text) if size is None else size).to_bytes(8, "little") + text + data)
    return folder


# ---- jobs of several processes ----------------------------------------------------------------------

def child_env(devices: int, barrier_timeout: float | None = None, extra: dict | None = None) -> dict:
    """The environment of a test's child process: ``devices`` CPU devices, this checkout and the
    folders of ``SUPPORT`` on the path, unbuffered output, ``DIO_TEST_BARRIER_TIMEOUT`` if given,
    ``extra``."""
    env = {**os.environ, **(extra or {})}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *SUPPORT] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("DIO_TEST_BARRIER_TIMEOUT", None)
    if barrier_timeout is not None:
        env["DIO_TEST_BARRIER_TIMEOUT"] = str(barrier_timeout)
    return env


def run_job(argv, processes: int, devices: int, extra_env=None, timeout: float = 180) -> list[dict]:
    """Run a job of ``processes`` processes of ``devices`` CPU devices each and return what each
    printed last as ``RESULT <json>``, in process order. ``argv(pid, port)`` is a process's
    command line (``port``: a free one for the coordinator), ``extra_env(pid)`` (if given) its
    extra environment. Fails the test, with the output's tail, for a process that exits non-zero
    or prints no result; a process still running after ``timeout`` seconds is killed (all are)."""
    port = free_port()
    procs = [subprocess.Popen(argv(pid, port), env=child_env(devices, extra=extra_env(pid) if extra_env else None),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
             for pid in range(processes)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for pid, (p, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            pytest.fail(f"process {pid} exited {p.returncode} without a result:\n{out[-2000:]}\n{err[-3000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
    return results


def start_job(script: str, args, processes: int = 4, devices: int = 2, barrier_timeout: float | None = None,
              extra: dict | None = None) -> list[subprocess.Popen]:
    """Start ``processes`` processes of tests/jobs/``script``, each run as ``script PROCESS PORT *args``
    (``devices`` CPU devices each, see ``child_env``), and return them (outputs piped, as text)."""
    env, port = child_env(devices, barrier_timeout, extra), free_port()
    return [subprocess.Popen([sys.executable, os.path.join(JOBS, script), str(i), str(port), *map(str, args)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(processes)]


def kill_job(procs):
    """SIGKILL each process still running (in the order given) and reap it."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
        p.wait()


def wait_for(procs, text: str, limit: float = 90) -> list[str]:
    """Each process's output up to the line ``text`` (failing, with its output, if it ends first or
    ``limit`` seconds pass)."""
    deadline, outs = time.monotonic() + limit, []
    for i, p in enumerate(procs):
        lines = []
        while text + "\n" not in lines:
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, \
                f"process {i} ended before {text!r}:\n{''.join(lines)}\n{p.stderr.read()[-4000:]}"
            lines.append(line)
        outs.append("".join(lines))
    return outs


def finish_job(procs, limit: float = 120) -> list[str]:
    """Each process's output once it exits (all killed after ``limit`` seconds); fails the test,
    with the tail of every failed process's output (which one failed first is often in another's), for
    a process that exits non-zero."""
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=limit)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    failed = [f"--- process {i} exited {code}:\n{out[-1500:]}{err[-3000:]}"
              for i, (code, out, err) in enumerate(outs) if code != 0]
    assert not failed, "\n".join(failed)
    return [out for _, out, _ in outs]


# ---- the local tier ---------------------------------------------------------------------------------

def one_leaf(mesh):
    """A state of one leaf ``w`` (256 x 64 float32 over the mesh's data and model axes): its restore
    target and ``state(step)``, a deterministic function of the step."""
    sharding = NamedSharding(mesh, P("data", "model"))
    target = {"w": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=sharding)}

    def state(step):
        return {"w": jax.device_put(np.arange(256 * 64, dtype=np.float32).reshape(256, 64) + step, sharding)}
    return target, state


def same_leaf(restored, expected) -> bool:
    """Whether ``restored["w"]`` has exactly the bytes of ``expected["w"]``."""
    return np.asarray(restored["w"]).tobytes() == np.asarray(expected["w"]).tobytes()


# The planners' fixture: a leaf of 4 regions over (data=2, fsdp=4) on 4 processes (regions 0, 1 held
# by {0, 2}; 2, 3 by {1, 3}) and a replicated leaf.
R = [((i * 16, i * 16 + 16), (0, 16)) for i in range(4)]
WANTED = {"['w']": {R[0]: (0, 2), R[1]: (0, 2), R[2]: (1, 3), R[3]: (1, 3)},
          "['b']": {((0, 32),): (0, 1, 2, 3)}}


def held(process):
    """What ``process`` holds of WANTED (as a local step records it)."""
    own = [list(map(list, r)) for r, holders in WANTED["['w']"].items() if process in holders]
    return as_regions({"['w']": own, "['b']": [[[0, 32]]]})


def train(root, tier, state, steps=9, persist_every=3):
    """Train ``steps`` steps under a manager of ``root`` with the local tier ``tier``, saving
    ``state(step)`` where the policies say (persistently every ``persist_every`` steps); returns
    the steps saved and the local steps left."""
    saved = []
    with dio.CheckpointManager(root, save_policy=dio.policies.EveryNSteps(persist_every), local=tier) as mgr:
        for step in range(steps):
            if mgr.should_save(step):
                mgr.save(step, state(step))
                saved.append(step)
        mgr.wait()
        return saved, mgr.local.steps()


def train_one_leaf(root, local, mesh, steps=9, offset=0):
    """:func:`train` of ``one_leaf``'s state (+ ``offset``), saving locally to ``local`` every 2 steps
    and persistently every 3."""
    _, state = one_leaf(mesh)
    return train(root, dio.LocalTier(local, save_policy=dio.policies.EveryNSteps(2)),
                 lambda step: jax.tree.map(lambda x: x + offset, state(step)), steps)


def asked_tiers(tmp_path, dispatcher):
    """A manager of ``tmp_path/root`` saving with ``dispatcher``, persistently only when forced (every
    100 steps otherwise), with a local tier at ``tmp_path/local/{process}`` saving only when asked
    (``save(local=True)``): what a test of chosen steps in chosen tiers opens, and opens again."""
    return dio.CheckpointManager(tmp_path / "root", dispatcher, save_policy=dio.policies.EveryNSteps(100),
                                 local=dio.LocalTier(tmp_path / "local" / "{process}"))


def filled(mesh, value):
    """A state of one leaf ``w`` (64 x 16 float32 over the data and model axes), every element ``value``."""
    return {"w": jax.device_put(np.full((64, 16), value, np.float32), NamedSharding(mesh, P("data", "model")))}


def filled_target(mesh):
    """The restore target of ``filled``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), filled(mesh, 0))


def value_of(tree) -> float:
    """The one value every element of ``tree["w"]`` holds (failing if they differ)."""
    values = np.unique(np.asarray(tree["w"]))
    assert values.size == 1, values
    return float(values[0])
