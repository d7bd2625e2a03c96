"""dispatch_io: controller-driven checkpoint IO for JAX.

    import dispatch_io as dio
    dispatcher = dio.LocalDispatcher(host_memory_budget=256 << 20)
    handle = dispatcher.save("ckpt/step_100", state)   # returns once SYNC leaves are off the device
    stats = handle.wait()                              # durable and committed
    restored = dispatcher.restore("ckpt/step_100", dio.metadata("ckpt/step_100"))
"""

from dispatch_io import sharding, tree
from dispatch_io.plan.batches import Priority
from dispatch_io.colocated import ColocatedDispatcher, ColocatedRunner
from dispatch_io.dispatcher import Dispatcher, LocalDispatcher
from dispatch_io.formats.exporting import ExportStats
from dispatch_io.formats.detect import metadata
from dispatch_io import policies
from dispatch_io.manager import CheckpointManager, Json, LocalTier, PerProcess, StepInfo
from dispatch_io.errors import BarrierTimeoutError, CheckpointError, CorruptCheckpointError, IncompleteCheckpointError, TreeMismatchError, WorkerError
from dispatch_io.options import Options
from dispatch_io.progress import RestoreStats, SaveStats
from dispatch_io.runner import LocalRunner
from dispatch_io.save.driver import SaveHandle
from dispatch_io.save import transfer  # dio.transfer.resolve names a LocalRunner's transfer (docs/api.md)

__all__ = [
    "BarrierTimeoutError", "CheckpointError", "CheckpointManager", "ColocatedDispatcher", "ColocatedRunner", "CorruptCheckpointError", "Dispatcher", "ExportStats", "IncompleteCheckpointError", "LocalDispatcher", "LocalRunner", "LocalTier", "Options", "Priority",
    "Json", "PerProcess", "RestoreStats", "SaveHandle", "SaveStats", "StepInfo", "TreeMismatchError", "WorkerError", "metadata",
    "policies", "sharding", "tree",
]
__version__ = "0.1.0"
