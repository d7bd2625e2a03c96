"""Grow XLA's pinned host pool once per dispatcher, so the first pinned save runs at the steady speed.

XLA serves ``pinned_host`` buffers from a pool it keeps (freed blocks are reused, never returned
to the OS). The first save that pins N bytes grows it by N first: on an H200 the first,
allocating device -> ``pinned_host`` call ran at 2.3 GB/s, later ones at 55 GB/s (issue 43).
:func:`grow` pays that once, when a pinned-path dispatcher is made, for the bytes a save may
hold pinned at once (the staging budget), so the first save is as fast as the tenth.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from dispatch_io.jax_compat import single_device_sharding


def grow(device, nbytes: int) -> float:
    """Allocate ``nbytes`` of ``device``'s ``pinned_host`` memory and free it again (into XLA's
    pool); returns the seconds it took. The source is ``np.zeros`` (untouched pages: reading
    them costs no host memory). Nothing is done for ``nbytes <= 0``. (Dispatchers skip CPU
    devices, whose pinned buffers are ordinary allocations with no pool to grow.)"""
    if nbytes <= 0:
        return 0.0
    t0 = time.perf_counter()
    pinned = jax.device_put(np.zeros(nbytes, np.uint8),
                            single_device_sharding(device, memory_kind="pinned_host"))
    pinned.block_until_ready()
    pinned.delete()
    return time.perf_counter() - t0
