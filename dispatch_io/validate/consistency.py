"""The parsed description (ours and Orbax's) is consistent: shapes, dtypes, chunk grids, names, sizes.

:func:`check_manifest` runs on a :class:`~dispatch_io.manifest.Manifest` of any format: logical
and stored shapes agree, chunk shapes tile the stored shape in at most :data:`MAX_CHUNKS` chunks,
saved checksums name chunks of the grid, names of stored arrays stay inside the checkpoint
(:func:`check_name`), sizes add up to ``total_bytes``.
"""

from __future__ import annotations

import functools
import math
import re

from dispatch_io.validate.fields import NAME, malformed
from dispatch_io.workers import ArraySpec, numpy_dtype

MAX_CHUNKS = 1 << 24          # chunks of one stored array: what a plan or a verify may iterate over


@functools.cache
def _key_data(impl: str) -> tuple[tuple[int, ...], str]:
    """(trailing dims, dtype name) of the ``key_data`` of one PRNG key of ``impl``."""
    import jax

    data = jax.eval_shape(jax.random.key_data, jax.random.key(0, impl=impl))
    return data.shape, data.dtype.name


def chunk_count(spec: ArraySpec) -> int:
    """How many chunks tile the stored array ``spec`` (its chunk shape over its shape)."""
    return math.prod(-(-n // c) for n, c in zip(spec.shape, spec.chunk_shape))


def check_manifest(manifest, where: str, names: re.Pattern | None = NAME) -> None:
    """Raise CorruptCheckpointError unless the parsed ``manifest`` (a Manifest) is consistent:
    each leaf's stored shape is its logical shape (keys: plus the impl's trailing dims), its
    chunk shape has its rank and tiles it in at most :data:`MAX_CHUNKS` chunks, its checksums
    name chunks of that grid, a packed leaf lies inside its pack, stored names match ``names``
    (None: names only need to be safe relative paths: Orbax's) and the stored bytes add up to
    ``total_bytes`` (when it is known, non-zero). A pair of stored and leaf dtype, and a
    stored array (a pack that thousands of leaves share), are checked once, not once per leaf."""
    total = 0
    dtypes_agree, arrays_checked = set(), set()   # (stored dtype, leaf dtype or key impl); id(stored array)
    for leaf in manifest.leaves:
        spec = leaf.stored
        if spec is None:
            continue
        keypath, expected = leaf.keypath, tuple(leaf.shape)
        if leaf.key_impl is not None:
            expected += _key_data(leaf.key_impl)[0]
        if spec.shape != expected:
            raise malformed(where, f"stored shape {list(spec.shape)} is not the leaf's {list(expected)}", keypath)
        pair = (spec.dtype, leaf.dtype if leaf.key_impl is None else leaf.key_impl)
        if pair not in dtypes_agree:
            _check_dtype(spec.dtype, leaf, where)
            dtypes_agree.add(pair)
        if id(array := spec.stored) not in arrays_checked:
            _check_tiling(array, names, where, keypath)
            arrays_checked.add(id(array))
        nbytes = spec.nbytes
        if spec.packed is not None:
            pack, offset = spec.packed
            if offset + nbytes > pack.shape[0]:
                raise malformed(where, f"bytes [{offset}, {offset + nbytes}) are not inside pack "
                                       f"{pack.name} of {pack.shape[0]} bytes", keypath)
        if leaf.checksums:
            grid = [-(-n // c) for n, c in zip(spec.shape, spec.chunk_shape)]
            for index in leaf.checksums:
                if len(index) != len(grid) or not all(0 <= i < n for i, n in zip(index, grid)):
                    raise malformed(where, f"a checksum of chunk {list(index)}, outside its chunk grid {grid}", keypath)
        total += nbytes
    if manifest.total_bytes and manifest.total_bytes != total:
        raise malformed(where, f"manifest.json: total_bytes {manifest.total_bytes} is not the {total} bytes "
                               "its leaves store")


def _check_dtype(stored: str, leaf, where: str) -> None:
    """Raise unless the stored dtype name ``stored`` is ``leaf``'s dtype (keys: its impl's key
    data dtype) and holds no Python objects."""
    dtype = getattr(leaf.dtype, "name", None) if leaf.key_impl is None else _key_data(leaf.key_impl)[1]
    if numpy_dtype(stored).name != dtype:
        raise malformed(where, f"stored dtype {stored} is not the leaf's {dtype}", leaf.keypath)
    if numpy_dtype(stored).hasobject:  # bytes read into Python object pointers
        raise malformed(where, f"dtype {stored} holds Python objects, never stored", leaf.keypath)


def _check_tiling(array: ArraySpec, names: re.Pattern | None, where: str, keypath: str) -> None:
    """Raise unless the stored ``array``'s chunk shape has its rank and tiles it in at most
    :data:`MAX_CHUNKS` chunks, and its name matches ``names`` (:func:`check_name`)."""
    if len(array.chunk_shape) != len(array.shape) or min(array.chunk_shape, default=1) < 1:
        raise malformed(where, f"chunk shape {list(array.chunk_shape)} does not tile stored shape "
                               f"{list(array.shape)}", keypath)
    if (count := chunk_count(array)) > MAX_CHUNKS:
        raise malformed(where, f"stored shape {list(array.shape)} in chunks of {list(array.chunk_shape)} is "
                               f"{count} chunks, more than {MAX_CHUNKS}", keypath)
    check_name(array.name, names, where, keypath)


def check_name(name: str, pattern: re.Pattern | None, where: str, keypath: str) -> None:
    """Raise CorruptCheckpointError unless the stored array name ``name`` matches ``pattern``
    (None: Orbax's names, which need only be relative paths without empty, ``.`` or ``..``
    components) -- a name that could lead outside the checkpoint's arrays."""
    if pattern is not None:
        safe = pattern.fullmatch(name) is not None
    else:
        parts = name.split("/")  # "": Orbax's tree of one leaf, stored at the item itself
        safe = name == "" or ("\0" not in name and "\\" not in name and all(p not in ("", ".", "..") for p in parts))
    if not safe:
        raise malformed(where, f"stored array name {name!r} is not a name inside the checkpoint", keypath)
