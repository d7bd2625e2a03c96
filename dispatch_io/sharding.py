"""Sharding tactics: restore targets for any mesh from a few rules, not hand-written shardings.

    from dispatch_io.sharding import fsdp, infer, replicate, shard

    rules = [
        (r"^rng$", replicate()),
        (r"/embed$", shard("model", None)),            # exactly this PartitionSpec
        (r"^params/.*/w$", [fsdp("data"), fsdp("model")]),
        (r"^opt_state/", fsdp(("data", "model"))),     # moments split over every device
    ]
    target = infer(dio.metadata(path), mesh, rules)    # ShapeDtypeStructs with NamedShardings
    state = dispatcher.restore(path, target)

**Matching.** A leaf's key path is matched in slash form, ``keystr(path, simple=True,
separator="/")``: ``params/layer0/w`` for ``['params']['layer0']['w']``, ``layers/3/b`` for a
list index. Each rule ``(pattern, tactics)`` is tried in order with ``re.search`` (anchor with
``^`` / ``$``); the first match decides the leaf and later rules are not consulted. A leaf that
no rule matches is replicated; end with ``(".*", fsdp("data"))`` for another default. A rule
that matches no leaf is fine, so one rule list can serve a training state and bare params.
``rules`` may also be a dict ``{pattern: tactics}`` (dicts keep their order).

**Tactics.** A tactic is any callable ``(spec, leaf, mesh, keypath) -> spec``: ``spec`` holds
one entry per dimension (None, a mesh axis name, or a tuple of names), ``leaf`` is a
``jax.ShapeDtypeStruct``, ``keypath`` the ``keystr`` path for messages. A rule's tactics run in
order, starting from a fully replicated spec. After each one, the spec is checked: one entry per
dimension, every axis in the mesh, no mesh axis used twice, every dimension divisible by the
product of its axes' sizes. Problems raise one ``ValueError`` listing every offending key path.
The result's PartitionSpecs drop trailing None entries: ``P()`` replicated, ``P("data")``.

**Leaves.** Anything with ``shape`` and ``dtype`` (``jax.Array``, ``ShapeDtypeStruct``, numpy)
becomes a ``ShapeDtypeStruct`` sharded on ``mesh`` (a sharding it had is ignored). PRNG keys
are sharded by their logical shape, as ``dio.metadata`` gives them; 0-d leaves are always
replicated. Python scalars, strings and None pass through unchanged.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Axes = str | tuple[str, ...] | None
Spec = tuple[Axes, ...]
Tactic = Callable[[Spec, jax.ShapeDtypeStruct, Mesh, str], Spec]
Rules = Sequence[tuple[str, Tactic | Sequence[Tactic]]] | Mapping[str, Tactic | Sequence[Tactic]]

__all__ = ["Tactic", "Rules", "replicate", "fsdp", "shard", "infer"]


def _names(axes: Axes) -> tuple[str, ...]:
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)


def _size(mesh: Mesh, axes: Axes) -> int:
    return math.prod(mesh.shape[a] for a in _names(axes))


def _check_known(axes: Axes, mesh: Mesh, keypath: str, who: str) -> None:
    for a in _names(axes):
        if a not in mesh.shape:
            raise ValueError(f"{keypath}: {who}: mesh axis {a!r} is not in the mesh (axes {tuple(mesh.axis_names)})")


def replicate() -> Tactic:
    """Keep the whole leaf on every device.

    Alone, it states intent and keeps later rules from matching (an unmatched leaf is
    replicated too). After a tactic of the same rule that sharded the leaf it is a conflict."""
    def tactic(spec: Spec, leaf: jax.ShapeDtypeStruct, mesh: Mesh, keypath: str) -> Spec:
        if any(a is not None for a in spec):
            raise ValueError(f"{keypath}: replicate() after an earlier tactic of the rule sharded it as {P(*spec)}")
        return spec
    return tactic


def fsdp(axis: str | tuple[str, ...] = "data", min_bytes: int = 4 << 20) -> Tactic:
    """Fully sharded data parallel: split one dimension over ``axis``.

    ``axis`` is a mesh axis name or a tuple of names (split over their product). The dimension
    chosen is the largest one not yet sharded whose size is divisible by that product (the
    first of equal sizes). Leaves under ``min_bytes`` (elements x itemsize; a PRNG key counts its
    key data) and leaves with no such dimension are left as they are: fsdp adapts to shapes and
    meshes instead of failing. An axis the mesh lacks is an error, even for a small leaf; so is
    an axis an earlier tactic of the rule already used (caught by the check after each tactic).
    """
    def tactic(spec: Spec, leaf: jax.ShapeDtypeStruct, mesh: Mesh, keypath: str) -> Spec:
        _check_known(axis, mesh, keypath, f"fsdp({axis!r})")
        if math.prod(leaf.shape) * leaf.dtype.itemsize < min_bytes:
            return spec
        size = _size(mesh, axis)
        free = [d for d, n in enumerate(leaf.shape) if spec[d] is None and n % size == 0]
        if not free:
            return spec
        dim = max(free, key=lambda d: (leaf.shape[d], -d))
        return spec[:dim] + (axis,) + spec[dim + 1:]
    return tactic


def shard(*entries: Axes | P) -> Tactic:
    """Exactly these PartitionSpec entries: ``shard("data", None)`` or ``shard(P("data", None))``.

    Entry i is the mesh axis (or tuple of axes) for dimension i; missing trailing entries and
    None leave their dimension to the rule's other tactics. Sharding a dimension an earlier
    tactic of the rule sharded differently, or giving more entries than the leaf has
    dimensions (a 0-d leaf has none), is an error; so is a size not divisible by the axes."""
    if len(entries) == 1 and isinstance(entries[0], P):
        entries = tuple(entries[0])

    def tactic(spec: Spec, leaf: jax.ShapeDtypeStruct, mesh: Mesh, keypath: str) -> Spec:
        if len(entries) > len(spec):
            raise ValueError(f"{keypath}: shard{entries} has {len(entries)} entries for {len(spec)} dimensions")
        new = list(spec)
        for dim, axes in enumerate(entries):
            if axes is None:
                continue
            if new[dim] is not None and _names(new[dim]) != _names(axes):
                raise ValueError(f"{keypath}: dimension {dim} is sharded over {new[dim]!r} by an earlier "
                                 f"tactic of the rule, and shard() asks for {axes!r}")
            new[dim] = axes
        return tuple(new)
    return tactic


def _checked(spec: Any, leaf: jax.ShapeDtypeStruct, mesh: Mesh, keypath: str) -> Spec:
    if not isinstance(spec, (tuple, list)):  # (a PartitionSpec is a tuple)
        raise ValueError(f"{keypath}: a tactic returned {spec!r}, not a spec with one entry per dimension")
    spec = tuple(spec)
    shape = tuple(leaf.shape)
    if len(spec) != len(shape):
        raise ValueError(f"{keypath}: a tactic returned {spec!r}, not one entry per dimension of shape {shape}")
    owner: dict[str, int] = {}
    for dim, axes in enumerate(spec):
        _check_known(axes, mesh, keypath, f"dimension {dim}")
        if len(set(_names(axes))) != len(_names(axes)):
            raise ValueError(f"{keypath}: dimension {dim} names a mesh axis twice: {axes!r}")
        for a in _names(axes):
            if a in owner:
                raise ValueError(f"{keypath}: mesh axis {a!r} would shard both dimension {owner[a]} and dimension {dim}")
            owner[a] = dim
        if shape[dim] % _size(mesh, axes):
            raise ValueError(f"{keypath}: dimension {dim} (size {shape[dim]}) is not divisible by mesh axes "
                             f"{axes!r} (size {_size(mesh, axes)})")
    return spec


def _compile(rules: Rules) -> list[tuple[re.Pattern, tuple[Tactic, ...]]]:
    compiled = []
    for pattern, tactics in (rules.items() if isinstance(rules, Mapping) else rules):
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"sharding rule {pattern!r} is not a valid regular expression: {e}") from None
        listed = isinstance(tactics, Sequence) and not isinstance(tactics, str)
        sequence = (tactics,) if callable(tactics) else tuple(tactics) if listed else ()
        if not sequence or not all(callable(t) for t in sequence):
            raise TypeError(f"sharding rule {pattern!r}: expected a tactic or a sequence of tactics, got {tactics!r}")
        compiled.append((regex, sequence))
    return compiled


def infer(tree: Any, mesh: Mesh, rules: Rules = ()) -> Any:
    """A restore target for ``tree`` on ``mesh``: every array leaf becomes a
    ``jax.ShapeDtypeStruct`` with ``NamedSharding(mesh, P(...))`` chosen by the first rule whose
    pattern ``re.search``-es its slash key path (see the module doc); other leaves are kept.

    ``tree`` is typically ``dio.metadata(path)``, but any tree of arrays or ShapeDtypeStructs
    works. Raises ``ValueError`` listing every leaf whose rule fails (with its key path, rule
    and the dimension and axes at fault), ``TypeError`` for a rule that is not a tactic."""
    compiled = _compile(rules)
    problems: list[str] = []

    def one(path: tuple, leaf: Any) -> Any:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        abstract = jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)
        spec: Spec = (None,) * len(abstract.shape)
        keypath = jax.tree_util.keystr(path)
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        for regex, tactics in compiled:
            if regex.search(name):
                try:
                    for tactic in tactics:
                        spec = _checked(tactic(spec, abstract, mesh, keypath), abstract, mesh, keypath)
                except ValueError as e:
                    where = "" if str(e).startswith(keypath) else f"{keypath}: "
                    problems.append(f"{where}{e} (shape {tuple(abstract.shape)}, rule {regex.pattern!r})")
                break
        while spec and spec[-1] is None:
            spec = spec[:-1]
        return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=NamedSharding(mesh, P(*spec)))

    target = jax.tree_util.tree_map_with_path(one, tree)
    if problems:
        raise ValueError(f"cannot shard {len(problems)} leaf(s) on mesh {dict(mesh.shape)}:\n  " + "\n  ".join(problems))
    return target
