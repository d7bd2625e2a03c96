"""The collectives that carry a scale-out restore's rows between processes (``scaleout``).

Each process puts its row (uint8, the same length everywhere) on its carrying device (its first,
:func:`carriers`) as its element of a ``(groups, members, width)`` array over those devices laid out
as the round's groups; one jitted call then moves the rows -- gloo on CPU, NVLink / ICI on
accelerators: :func:`gather` (an all-gather within each group), :func:`group_sum` (a sum within each
group) or :func:`send` (a collective permute: each sender's row to one receiver, nothing back).
Every process of the groups calls the same one together.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@functools.partial(jax.jit, static_argnums=1)
def _reshard(rows, sharding):
    return jax.lax.with_sharding_constraint(rows, sharding)


def carriers(count: int) -> list:
    """The device of each process that carries its rows: its first (one pass over the job's devices)."""
    first: dict = {}
    for d in jax.devices():
        if d.process_index not in first or d.id < first[d.process_index].id:
            first[d.process_index] = d
    return [first[p] for p in range(count)]


@functools.partial(jax.jit, static_argnums=1)
def _sum_rows(rows, sharding):
    return jax.lax.with_sharding_constraint(rows.sum(1, dtype=rows.dtype), sharding)


def _rows(row: np.ndarray, groups: tuple, devices: list):
    """(this process's ``row`` as its element of a (groups, members, len) array, one row per
    device of ``devices`` laid out as ``groups``; the mesh)."""
    mesh = Mesh(np.array([[devices[p] for p in group] for group in groups]), ("group", "member"))
    mine = jax.device_put(row[None, None], devices[jax.process_index()])
    sharding = NamedSharding(mesh, PartitionSpec("group", "member"))
    return jax.make_array_from_single_device_arrays((len(groups), len(groups[0]), row.size), sharding, [mine]), mesh


def gather(row: np.ndarray, groups: tuple, devices: list) -> np.ndarray:
    """The ``row`` of every process of this process's group (uint8, the same length everywhere),
    as a (members, len) host array in group order, through ``devices`` (:func:`carriers`): an
    all-gather within each of ``groups`` (a partition of the processes into groups of one
    size); every process calls it together."""
    rows, mesh = _rows(row, groups, devices)
    return np.asarray(_reshard(rows, NamedSharding(mesh, PartitionSpec("group"))).addressable_data(0))[0]


def group_sum(row: np.ndarray, groups: tuple, devices: list) -> np.ndarray:
    """The sum of the ``row`` of each process of this process's group (uint8, each member's part
    at its own offsets and zeros elsewhere: the parts joined, in every member), as :func:`gather`."""
    rows, mesh = _rows(row, groups, devices)
    return np.asarray(_sum_rows(rows, NamedSharding(mesh, PartitionSpec("group"))).addressable_data(0))[0]


@functools.partial(jax.jit, static_argnums=(1, 2))
def _send_rows(rows, mesh, pairs):
    return jax.shard_map(lambda row: jax.lax.ppermute(row, ("group", "member"), perm=pairs), mesh=mesh,
                         in_specs=PartitionSpec("group", "member"), out_specs=PartitionSpec("group", "member"))(rows)


def send(row: np.ndarray, groups: tuple, devices: list, pairs: tuple) -> np.ndarray:
    """The row sent to this process (zeros where none is: a process may send and receive in one
    call -- a parity rebuild's member that is also a holder), as :func:`gather`: each (sender,
    receiver) of ``pairs`` -- positions in the (groups, members) grid -- sends its ``row`` to the
    receiver alone (a collective permute); every process of ``groups`` calls it together."""
    return Sender(groups, devices, pairs, row.size)(row)


@functools.lru_cache(maxsize=32)
def _send_program(groups: tuple, devices: tuple, pairs: tuple, size: int):
    """:func:`send`'s program for rows of ``size`` bytes, compiled once per process for each
    (groups, devices, pairs, size), as ``jax.jit`` keeps its own: a restore sends many rows of a
    few shapes, and compiling one costs 20-40 ms of CPU (on CPU)."""
    mesh = Mesh(np.array([[devices[p] for p in group] for group in groups]), ("group", "member"))
    spec = jax.ShapeDtypeStruct((len(groups), len(groups[0]), size), np.uint8,
                                sharding=NamedSharding(mesh, PartitionSpec("group", "member")))
    return _send_rows.lower(spec, mesh, pairs).compile()


class Sender:
    """:func:`send` of rows of ``size`` bytes among ``groups`` (``pairs`` as there), its program
    compiled when made (or taken from the ones this process compiled before) -- so a caller can
    make its senders while it waits for the rows (a parity rebuild's lost process is a fresh one)."""

    def __init__(self, groups: tuple, devices: list, pairs: tuple, size: int):
        self.groups, self.devices = groups, devices
        self._program = _send_program(tuple(map(tuple, groups)), tuple(devices), tuple(map(tuple, pairs)), size)

    def __call__(self, row: np.ndarray) -> np.ndarray:
        rows, _ = _rows(row, self.groups, self.devices)
        return np.asarray(self._program(rows).addressable_data(0))[0, 0]
