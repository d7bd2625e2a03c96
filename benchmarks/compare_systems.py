"""The systems benchmarks/compare.py measures: one adapter each (save, async save, restore, close).

dispatch_io in its variants (layouts, compression, data files, colocated, another checkout as a
baseline), Orbax (defaults, and limited to the same host memory budget), dispatch_io restoring
Orbax's checkpoint, and JAX's own array serialization. An adapter is built in the child process
that measures it, with the host memory budget in bytes; ``missing()`` says why it cannot run here.
"""

import tree as bt  # noqa: I001  (first: sets XLA_FLAGS for 8 CPU devices before jax is imported)

import importlib.metadata
import os

import jax

import dispatch_io as dio

MiB = 1 << 20
SAVE_MODES = ("save", "async", "async_sync")
MODES = ("save", "async", "restore", "restore_warm")
DISPATCH_IO_MODES = ("save", "async", "async_sync", "restore", "restore_warm")


def only_step_sync(keypath, spec):
    """dispatch_io priority for the async mode: ``step`` before save() returns, the rest LOW."""
    return dio.Priority.SYNC if keypath == "['step']" else dio.Priority.LOW


# ---- adapters: one per system --------------------------------------------------------------------

class DispatchIO:
    """dispatch_io.LocalDispatcher with the given host memory budget; one dispatcher per process."""

    name = "dispatch_io"
    dispatcher_cls = dio.LocalDispatcher
    options: dict = {}
    has_budget = True
    modes = DISPATCH_IO_MODES

    def __init__(self, budget: int):
        self.dispatcher = self.dispatcher_cls(host_memory_budget=budget, **self.options)

    @classmethod
    def missing(cls) -> str | None:
        """Why this system cannot run here, or None: the dispatcher must take its options."""
        if not cls.options:
            return None
        try:
            cls(64 * MiB).close()
        except TypeError as exc:
            return f"{cls.dispatcher_cls.__name__}(**{cls.options}) raised TypeError: {exc}"
        return None

    def save(self, tree, path):
        return self.dispatcher.save(path, tree).wait()

    def save_async(self, tree, path):
        return self.dispatcher.save(path, tree, priority=only_step_sync).wait

    def save_async_sync(self, tree, path):
        return self.dispatcher.save(path, tree, priority=lambda keypath, spec: dio.Priority.SYNC).wait

    def restore(self, abstract, path):
        return self.dispatcher.restore(path, abstract)

    def close(self):
        self.dispatcher.close()


class DispatchIOFiles(DispatchIO):
    """dispatch_io.LocalDispatcher(layout="files"): one file per chunk instead of OCDBT data files."""

    name = "dispatch_io_files"
    options = {"layout": "files"}


class DispatchIOZstd(DispatchIO):
    """dispatch_io.LocalDispatcher(compression="zstd"): the same save, chunks zstd-compressed."""

    name = "dispatch_io_zstd"
    options = {"compression": "zstd"}


class DispatchIOFewFiles(DispatchIO):
    """dispatch_io.LocalDispatcher(data_file_bytes=None): one OCDBT data file per batch."""

    name = "dispatch_io_fewfiles"
    options = {"data_file_bytes": None}


class DispatchIOColocated(DispatchIO):
    """dispatch_io.ColocatedDispatcher (colocated_python, in-process on the CPU devices here)."""

    name = "dispatch_io_colocated"
    dispatcher_cls = dio.ColocatedDispatcher


class DispatchIOBaseline(DispatchIO):
    """dispatch_io.LocalDispatcher from another checkout (``--baseline PATH``, e.g. a
    ``git worktree`` of an older commit): before/after figures from one interleaved run. Its
    children import that checkout's ``dispatch_io`` and ``workers`` (PYTHONPATH)."""

    name = "dispatch_io_baseline"

    @classmethod
    def missing(cls) -> str | None:
        return None if os.environ.get(BASELINE_ENV) else "needs --baseline PATH (another checkout)"


BASELINE_ENV = "DISPATCH_IO_BENCH_BASELINE"


class Orbax:
    """orbax.checkpoint.StandardCheckpointer with its defaults (optional: never a dependency)."""

    name = "orbax"
    has_budget = False
    modes = MODES

    def __init__(self, budget: int):
        import orbax.checkpoint as ocp
        self.checkpointer = ocp.StandardCheckpointer()

    @classmethod
    def missing(cls) -> str | None:
        try:
            importlib.metadata.version("orbax-checkpoint")
            import orbax.checkpoint  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"orbax-checkpoint not importable ({type(exc).__name__}: {exc})"
        return None

    def save(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), tree)
        self.checkpointer.wait_until_finished()

    def save_async(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), tree)
        return self.checkpointer.wait_until_finished

    def restore(self, abstract, path):
        return self.checkpointer.restore(os.path.abspath(path), abstract)

    def close(self):
        self.checkpointer.close()


class OrbaxLimited(Orbax):
    """Orbax (0.12.8) holding at most the dispatch_io budget of host memory.

    StandardCheckpointHandler's ``save_concurrent_gb`` limits only the bytes being written,
    "NOT device-to-host transfer", and it does not expose the knob that does. So this is a
    ``PyTreeCheckpointHandler`` (the handler StandardCheckpointHandler wraps, same defaults: OCDBT,
    zarr2, zstd) with ``save_device_host_concurrent_gb`` = budget (device->host copies in flight,
    in batches of arrays: a batch is written before the next one is copied) and
    ``restore_concurrent_gb`` = budget (bytes read in flight). Both count GB of 10^9 bytes, so
    budget / 1e9 is passed. The device->host limit applies only to leaves the ArrayHandler's
    SerializationStatusCallback marks ASYNCHRONOUS_*; the default callback marks every leaf
    SYNCHRONOUS (all copied at once, limit ignored). So jax.Array leaves get an ArrayHandler (in
    a registry of this handler only) whose callback makes every leaf but ``step``
    ASYNCHRONOUS_DEPRIORITIZED, as our async mode does: save() returns before the big copies.
    TransferPriority is only in orbax.checkpoint._src (its docstring's own example imports it so).

    Semantics to keep in mind when reading the rows: the save limit packs whole arrays, so an
    array larger than the budget is still copied to host in one piece (RSS above the budget);
    the restore limit is per shard read and raises ValueError for a shard of the budget or more.
    """

    name = "orbax_limited"
    has_budget = True

    def __init__(self, budget: int):
        import orbax.checkpoint as ocp
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
        from orbax.checkpoint._src.serialization.types import DefaultSerializationStatusCallback, TransferPriority

        class OnlyStepSync(DefaultSerializationStatusCallback):
            """``step`` copied before save() returns, every other leaf later, within the limit."""

            def key_priority(self, keypath):
                is_step = jax.tree_util.keystr(tuple(keypath)) == "['step']"
                return TransferPriority.SYNCHRONOUS if is_step else TransferPriority.ASYNCHRONOUS_DEPRIORITIZED

        handler = ocp.type_handlers.ArrayHandler(array_metadata_store=Store(), callback=OnlyStepSync())
        self.ocp = ocp
        self.checkpointer = ocp.AsyncCheckpointer(ocp.PyTreeCheckpointHandler(
            save_device_host_concurrent_gb=budget / 1e9, restore_concurrent_gb=budget / 1e9,
            type_handler_registry=ocp.type_handlers.create_type_handler_registry((jax.Array, handler))))

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        self.checkpointer.save(os.path.abspath(path), args=self.ocp.args.PyTreeSave(tree))
        return self.checkpointer.wait_until_finished

    def restore(self, abstract, path):
        restore_args = self.ocp.checkpoint_utils.construct_restore_args(abstract)
        return self.checkpointer.restore(os.path.abspath(path),
                                         args=self.ocp.args.PyTreeRestore(abstract, restore_args=restore_args))


class DispatchIOOnOrbax(Orbax):
    """dispatch_io restoring a checkpoint that Orbax wrote: the save is Orbax's own
    (StandardCheckpointer with its defaults: OCDBT, zarr2, zstd; the same as the ``orbax`` row's),
    the restores are ``LocalDispatcher(host_memory_budget=--budget-mib)`` reading that Orbax
    checkpoint. Compare its restore rows with the ``orbax`` rows: the same tree, the same format,
    each system restoring it."""

    name = "dispatch_io_on_orbax"
    has_budget = True
    budgeted_saves = False  # its save is Orbax's
    modes = ("save", "restore", "restore_warm")

    def __init__(self, budget: int):
        super().__init__(budget)
        self.dispatcher = dio.LocalDispatcher(host_memory_budget=budget)

    def restore(self, abstract, path):
        return self.dispatcher.restore(os.path.abspath(path), abstract)

    def close(self):
        super().close()
        self.dispatcher.close()


class JaxSerialization:
    """jax.experimental.array_serialization.serialization.GlobalAsyncCheckpointManager with the
    defaults of that module's get_tensorstore_spec: every leaf one zarr (v2) array directory under
    ``path``, named by its key path, one file per shard, no OCDBT. save = serialize (returns once
    the device data is copied to host) + wait_until_finished; restore = deserialize onto the
    target shardings (its default limit of 32 GB read in flight). It writes no tree
    metadata and rejects key<fry> arrays, so PRNG keys are stored as their key_data (and come back
    with the default implementation, the one benchmarks/tree.py uses)."""

    name = "jax_serialization"
    has_budget = False
    modes = MODES

    def __init__(self, budget: int):
        from jax.experimental.array_serialization import serialization
        self.ser = serialization
        self.manager = serialization.GlobalAsyncCheckpointManager()

    @classmethod
    def missing(cls) -> str | None:
        return None

    def _specs(self, tree, path):
        """One TensorStore spec per leaf: a zarr directory under path named by the leaf's key path."""
        root = os.path.abspath(path)
        names = [".".join(str(getattr(k, "key", k)) for k in keypath)
                 for keypath, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
        return [self.ser.get_tensorstore_spec(os.path.join(root, name)) for name in names]

    def save(self, tree, path):
        self.save_async(tree, path)()

    def save_async(self, tree, path):
        data = [jax.random.key_data(x) if bt.is_key(x) else x for x in jax.tree.leaves(tree)]
        self.manager.serialize(data, self._specs(tree, path), on_commit_callback=None)
        return self.manager.wait_until_finished

    def restore(self, abstract, path):
        flat, treedef = jax.tree.flatten(abstract)
        stored = [jax.eval_shape(jax.random.key_data, a) if bt.is_key(a) else a for a in flat]
        out = self.manager.deserialize([a.sharding for a in flat], self._specs(abstract, path),
                                       [s.shape for s in stored], [s.dtype for s in stored])
        out = [jax.random.wrap_key_data(x) if bt.is_key(a) else x for x, a in zip(out, flat)]
        return jax.tree.unflatten(treedef, out)

    def close(self):
        self.manager.wait_until_finished()


SYSTEMS = {cls.name: cls for cls in (DispatchIO, DispatchIOFiles, DispatchIOColocated, DispatchIOZstd,
                                     DispatchIOFewFiles, DispatchIOBaseline, Orbax, OrbaxLimited, DispatchIOOnOrbax, JaxSerialization)}
DISPATCH_IO_SYSTEMS = tuple(name for name, cls in SYSTEMS.items() if issubclass(cls, DispatchIO))


def available_systems(wanted) -> tuple[list[str], list[str]]:
    """(the wanted systems that can run here, notes on the ones that cannot)."""
    systems, notes = [], []
    for name in wanted:
        why = SYSTEMS[name].missing()
        if why:
            notes.append(f"NOTE: {name} skipped: {why}")
            print(notes[-1], flush=True)
        else:
            systems.append(name)
    return systems, notes
