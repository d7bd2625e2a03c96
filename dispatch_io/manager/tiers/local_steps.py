"""The local tier's steps on disk: which of them belong to this manager, and what each holds.

Each local step's ``info.json`` records the persistent root it was saved beside (``"root"``),
the regions it holds (``"held"``) and its commit time (``"committed"``). A step of another root
(a new run reusing the local path, or one written before steps recorded their root) is never
used, and removed when a manager opens (:func:`read_steps`). A step whose info cannot be read (a
torn write on a full RAM disk) is treated as lost, as a wiped directory is: logged with its path,
never reported as held.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
from typing import TYPE_CHECKING

from absl import logging

from dispatch_io.manager.tiers import parity_plan, placement
from dispatch_io.manager.tiers.parity import PARITY
from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import BarrierTimeoutError, CorruptCheckpointError
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import items as items_lib
from dispatch_io.manager import step_policies
from dispatch_io.manifest import ARRAYS
from dispatch_io.storage import INFO, MAX_MANIFEST_BYTES, Location, StepRoot
from dispatch_io.storage.directory import read_regular

if TYPE_CHECKING:  # annotations only: tier.py imports this module
    from dispatch_io.manager.tiers.tier import LocalTiers


def owner(root: StepRoot) -> str:
    """What identifies the persistent root in a local step's info: its URL, or its real path."""
    display = root.display
    return display if "://" in display else os.path.realpath(display)


def read_info(root: StepRoot, step: int) -> dict | None:
    """Local ``step``'s info, or None (logged, naming the file) if it cannot be read or is not a
    local step's: the step is then lost to this process, as a wiped one is."""
    path = os.path.join(root.step_path(step), INFO)
    try:  # through the storage's bounded read: a FIFO or /dev/zero there never hangs the restore
        info = json.loads(read_regular(path, MAX_MANIFEST_BYTES))
    except (OSError, ValueError, RecursionError) as exc:
        logging.warning("dispatch_io: the local step %s is not used (its info cannot be read: %s)", path, exc)
        return None
    if not isinstance(info, dict) or info.get("tier") != "local" or not _regions(info.get("held")):
        logging.warning("dispatch_io: the local step %s is not used (its info records no held regions)", path)
        return None
    return info


def _regions(held) -> bool:
    """Whether ``held`` is what a local step records: {key path: [region, ...]}, each region a list
    of [start, stop] integer pairs (anything else, e.g. a bit flip on a RAM disk, loses the step)."""
    def bounds(pair):
        return (isinstance(pair, list) and len(pair) == 2 and all(type(b) is int for b in pair)
                and 0 <= pair[0] <= pair[1])
    return isinstance(held, dict) and all(
        isinstance(k, str) and isinstance(regions, list) and all(
            isinstance(region, list) and all(bounds(pair) for pair in region) for region in regions)
        for k, regions in held.items())


def read_steps(root: StepRoot, owned_by: str, remove: bool = False) -> tuple[dict[int, dict], list[str]]:
    """({step: info} of the committed local steps saved beside the root ``owned_by``, [the info
    files that could not be read]). Steps of another root are left out; with ``remove``, deleted
    (logged): what a manager does when it opens."""
    infos, unreadable = {}, []
    for step in root.committed_steps():
        info = read_info(root, step)
        if info is None:
            unreadable.append(os.path.join(root.step_path(step), INFO))
        elif info.get("root") != owned_by:
            if remove:
                logging.warning("dispatch_io: local step %s was saved beside %s, not %s: removed",
                                root.step_path(step), info.get("root"), owned_by)
                root.delete(step)
        else:
            infos[step] = info
    return infos, unreadable


def record(step: int, info: dict | None) -> step_policies.StepRecord:
    """``step``'s :class:`~dispatch_io.manager.step_policies.StepRecord` from its local info (None: no
    readable info): its time -- the job-wide ``"time"`` where the job agreed one (a clock-reading keep
    policy in a multi-process job), else its commit time -- and the metrics the local save recorded
    (numbers only)."""
    if info is None:
        return step_policies.StepRecord(step)
    metrics = info.get("metrics") if isinstance(info.get("metrics"), dict) else {}
    committed = info.get("time", info.get("committed"))
    return step_policies.StepRecord(step, committed if type(committed) in (int, float) else None, {
        k: float(v) for k, v in metrics.items() if isinstance(k, str) and type(v) in (int, float)})


def share_manifest(room, step: int, having: list[int], process: int, read) -> dict | None:
    """The manifest of local ``step`` (JSON) for a process without a copy of it -- every copy's
    manifest describes the same stored arrays, so it plans its part with a peer's --, shared by the
    first of ``having`` (the processes with a copy, ascending; ``read()`` gives it there) through
    ``room``; None in the processes with a copy of their own, and where none has one.
    BarrierTimeoutError naming the sharer if it does not share it within the room's timeout."""
    if process in having:
        if process == having[0]:
            room.set(f"manifest/{step}", read())
        return None
    if not having:
        return None
    doc = room.wait_for(f"manifest/{step}", room.timeout)
    if doc is None:
        raise BarrierTimeoutError(f"process {having[0]} did not share the manifest of local step {step} within "
                                  f"{room.timeout:g} s", processes=[having[0]], barrier=f"{room.prefix}/manifest/{step}")
    return doc


def whole_steps(local: "LocalTiers", persistent_steps: list[int]) -> dict[int, str]:
    """{step: durability} of the steps the job can restore whole (``placement.whole_steps``): ``persistent_steps``
    and the local steps whose every region some process's local copy holds. In a multi-process job every
    process calls it together: one gather, in a named room, of what each process's local steps
    hold, with process 0's listing of the root, so every process gets the same list (as
    ``should_save`` answers alike). BarrierTimeoutError naming a process that does not come."""
    infos = local.infos()[0]
    mine = {str(step): {"held": info["held"], "shapes": info.get("shapes"), "copies": info.get("copies"),
                        **parity_report(local.root, step, info)} for step, info in infos.items()}
    if local.count == 1:
        return placement.whole_steps({local.process: infos}, persistent_steps)
    template = local.tier.process_path("{process}")
    room = open_room("tiers-steps", template, f"the listing of the steps of the local tier {template}",
                     local.dispatcher.options.barrier_timeout)
    if room.leader:
        room.set("persistent", list(persistent_steps))
    room.set(f"held/{local.process}", mine)
    gathered = room.gather("held")
    persistent = room.from_leader("persistent")
    room.close()
    reports = {p: {int(s): r for s, r in held.items()} for p, held in gathered.items()}
    for step, lost in parity_plan.rebuilt_steps(reports, local.count).items():   # parity rebuilds them
        present = next(held[step] for held in reports.values() if step in held)
        for p, regions in lost.items():
            reports.setdefault(p, {})[step] = {**present, "held": {k: [[list(b) for b in r] for r in sorted(v)]
                                                                   for k, v in regions.items()}}
    return placement.whole_steps(reports, persistent)


def parity_report(root: StepRoot, step: int, info: dict) -> dict:
    """What local ``step`` (``info``: its info) tells the job of its parity: {"parity": its section
    (``parity_plan``), "committed": whether its parity rows are, "process": the process that saved
    it (its place in the ring)}, or {} without parity."""
    if not isinstance(info.get("parity"), dict):
        return {}
    path = os.path.join(root.step_path(step), PARITY)
    return {"parity": info["parity"], "committed": Location.parse(path).is_committed(), "process": info.get("process")}


def check_apart(template: str, path: str, process: int, count: int, timeout: float,
                newest: int | None) -> tuple[list[str], int | None]:
    """(each process's host name by process index, the newest of the processes' ``newest`` local
    steps), gathered in one named room: the last local step every process starts from (a process
    whose local directory was lost takes the others', so the local policy answers alike
    everywhere). ValueError (in every process) if two processes of the job would save into the
    same local directory (one host, a path without ``{process}``): they would replace each
    other's steps."""
    if count < 2:
        return [socket.gethostname()], newest
    room = open_room("tiers-paths", template, f"the local tier {template}", timeout)
    room.set(f"path/{process}", [socket.gethostname(), os.path.realpath(path), newest])
    places = room.gather("path")
    room.close()
    seen: dict[tuple, int] = {}
    for p in sorted(places):
        where = tuple(places[p][:2])
        if where in seen:
            raise ValueError(f"LocalTier({template!r}): processes {seen[where]} and {p} would both save into "
                             f"{where[1]} on host {where[0]}; put {{process}} in the path (it becomes the "
                             "process index)")
        seen[where] = p
    steps = [places[p][2] for p in range(count) if isinstance(places[p][2], int)]
    return [places[p][0] for p in range(count)], max(steps, default=None)


def prepare_save(local: "LocalTiers | None", step: int, forced: bool | None, persist: bool,
                 root_latest=None) -> bool:
    """Whether a manager's save of ``step`` saves it in the local tier ``local``: ``forced`` (the
    ``save(local=)`` argument) if given, else the tier's save policy. If either tier saves, the
    local steps from ``step`` on are deleted first (``LocalTiers.drop_from``). ValueError for
    ``local=True`` without a local tier, and for a local save alone of a step the root holds one as
    new as (``root_latest``: (the newest step the manager saw persisted, a call listing the root's
    newest)): the root's would be of the history before a rollback, and a restore could mix them."""
    if forced is not None and not isinstance(forced, bool):
        raise TypeError(f"save(local={forced!r}): True, False or None")
    if local is None:
        if forced:
            raise ValueError("save(local=True) on a CheckpointManager without a local tier "
                             "(pass local=dio.LocalTier(...))")
        return False
    saves = local.should_save(step) if forced is None else forced
    if saves and not persist and root_latest and root_latest[0] is not None and step <= root_latest[0]:
        newest = root_latest[1]()   # listed only then: the manager's view may be stale
        if newest is not None and step <= newest:
            raise ValueError(f"cannot save step {step} in the local tier alone: the root holds step {newest}, of "
                             f"the history before a rollback, which a restore could mix with it; remove the root's "
                             f"steps from {step} on first, or save the step to both tiers")
    if saves or persist:
        local.drop_from(step)
    return saves


def save(local: "LocalTiers | None", step: int, tree, forced: bool | None, persist: bool, items, info: dict,
         save_kwargs: dict, root_latest=None):
    """The local tier's part of a manager's ``save()`` of ``step`` (its handle; None if the tier does
    not save it: :func:`prepare_save`): this process's regions of ``tree``, its item files (its own
    PerProcess values and every Json item: ``items.files(own_step=True)``), and the step info's
    items, metrics and metadata (``info``, as ``info.make`` gives it)."""
    if not prepare_save(local, step, forced, persist, root_latest):
        return None
    checksums = any(entry.get("crc32c") for entry in info["items"].values())  # as the root's step says
    return local.save(step, tree, items_lib.files(items, local.process, own_step=True, checksums=checksums)[0],
                      {k: info[k] for k in ("items", "metrics", "metadata")}, **save_kwargs)


def check_save_keywords(dispatcher, save_kwargs: dict):
    """TypeError for a keyword ``Dispatcher.save`` does not take, before (and whether or not) anything is saved."""
    try:
        inspect.signature(dispatcher.save).bind(None, None, **save_kwargs)
    except TypeError as exc:
        raise TypeError(f"CheckpointManager.save(): {exc} (its keywords are Dispatcher.save's)") from None


def durability(local: "LocalTiers | None", step: int, persistent_steps) -> str | None:
    """``"persisted"`` if ``step`` is among ``persistent_steps``, else, if this process's local tier
    ``local`` has it, ``"replicated k"``, ``"parity k"`` or ``"local"`` (``placement.durability`` of its
    copies and parity); None."""
    if step in persistent_steps:
        return "persisted"
    info = local.infos()[0].get(step) if local is not None else None
    if info is None:
        return None
    parity = parity_report(local.root, step, info)   # "parity k" once its rows committed
    return placement.durability(info.get("copies"), False, parity["parity"].get("k") if parity.get("committed") else None)


def read_item(local: "LocalTiers", step: int, name: str, persistent: str):
    """Item ``name`` of ``step`` for this process, from its local copy of the step (a step the
    persistent root ``persistent`` does not hold). FileNotFoundError naming the step and process
    if this process has no copy (lost with its local directory: a PerProcess value was only
    there); KeyError listing the copy's items; CheckpointError for a malformed item."""
    info = local.infos()[0].get(step)
    path = local.root.step_path(step)
    if info is None:
        raise FileNotFoundError(f"step {step} is not committed in {persistent}, and process {local.process} has no "
                                f"local copy of it at {path} (lost with its local directory?): its items are gone with "
                                "that copy; resume from a step whose items survive (a persistent one: restore(step, "
                                "target)), or start the items afresh")
    entries = info.get("items", {})
    if not info_lib.items_ok(entries):   # a bit flip on a RAM disk, a torn write
        raise CorruptCheckpointError(f"{path}: its info's items are not what a local save records (malformed "
                                     "checkpoint)", path=path)
    entry = entries.get(name)
    if entry is None:
        raise KeyError(f"local step {step} at {path} has no item {name!r} "
                       f"(it has: {', '.join(sorted(entries)) or 'none'})")
    location = Location.parse(path)
    return items_lib.read(lambda key: location.read_file(ARRAYS + key), name, entry, step, local.process,
                          local.count, path)[2]


def verify_items(local: "LocalTiers", step: int, persistent: str) -> int:
    """Read and check (against their CRC-32Cs, where saved with them) the item files of this process's
    copy of local ``step``; how many. Raises as :func:`read_item`."""
    names = list((local.infos()[0].get(step) or {}).get("items") or ())
    for name in names:
        read_item(local, step, name, persistent)
    return len(names)
