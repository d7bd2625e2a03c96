"""The local tier's steps on disk: which of them belong to this manager, and what each holds.

Each local step's ``info.json`` records the persistent root it was saved beside (``"root"``),
the regions it holds (``"held"``) and its commit time (``"committed"``). A step of another root
(a new run reusing the local path, or one written before steps recorded their root) is never
used, and removed when a manager opens (:func:`read_steps`). A step whose info cannot be read (a
torn write on a full RAM disk) is treated as lost, as a wiped directory is: logged with its path,
never reported as held.

Plain values in, facts out: nothing here knows the tier (``tier.LocalTiers`` calls these with its
root and infos; what the job agrees about its local steps is ``job_steps``).
"""

from __future__ import annotations

import json
import os

from absl import logging

from dispatch_io.manager.tiers import placement
from dispatch_io.manager.tiers.parity import PARITY
from dispatch_io.errors import CheckpointError, CorruptCheckpointError
from dispatch_io.manager import info as info_lib
from dispatch_io.manager import items as items_lib
from dispatch_io.manager import step_policies
from dispatch_io.manifest import ARRAYS
from dispatch_io.storage import INFO, MAX_MANIFEST_BYTES, Location, StepRoot, sealed
from dispatch_io.storage.directory import read_regular


def owner(root: StepRoot) -> str:
    """What identifies the persistent root in a local step's info: its URL, or its real path."""
    display = root.display
    return display if "://" in display else os.path.realpath(display)


def read_info(root: StepRoot, step: int) -> dict | None:
    """Local ``step``'s info, or None (logged, naming the file) if it cannot be read or is not a
    local step's: the step is then lost to this process, as a wiped one is."""
    path = os.path.join(root.step_path(step), INFO)
    try:  # through the storage's bounded read: a FIFO or /dev/zero there never hangs the restore
        info = sealed.loads(read_regular(path, MAX_MANIFEST_BYTES))
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


def agreed(info: dict) -> bool:
    """Whether this process's local step ``info`` says the job agreed it whole: a multi-process
    local save's info says ``"agreed": false`` until every process committed the step
    (``SaveAgreement``); an info without it (a single process's) is agreed."""
    return info.get("agreed", True) is True


def agreed_steps(flags: dict[int, dict]) -> set:
    """The steps some process's info says the job agreed whole (``flags``: {process: {step:
    :func:`agreed`}}, gathered): what a restore and the job's listing count -- not a step some
    process never committed or reported (it died mid-save, after its replicas or parity went out), however
    much of it the others' directories hold; and one every process committed though a process
    died before its info said so (one process's word is the job's agreement). Retention counts
    every committed step."""
    return {step for mine in flags.values() for step, ok in mine.items() if ok}


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


def parity_report(root: StepRoot, step: int, info: dict) -> dict:
    """What local ``step`` (``info``: its info) tells the job of its parity: {"parity": its section
    (``parity_plan``), "committed": whether its parity rows are, "process": the process that saved
    it (its place in the ring)}, or {} without parity."""
    if not isinstance(info.get("parity"), dict):
        return {}
    path = os.path.join(root.step_path(step), PARITY)
    return {"parity": info["parity"], "committed": Location.parse(path).is_committed(), "process": info.get("process")}




def durability(root: StepRoot, step: int, info: dict) -> str:
    """What this process's local copy of ``step`` (``info``: its info, under ``root``) says of its
    durability: ``"replicated k"``, ``"parity k"`` (only once its parity rows committed) or
    ``"local"`` (``placement.durability`` of its copies and parity)."""
    parity = parity_report(root, step, info)
    return placement.durability(info.get("copies"), False, parity["parity"].get("k") if parity.get("committed") else None)


def read_item(root: StepRoot, step: int, info: dict | None, name: str, process: int, count: int, persistent: str,
              shared: dict | None = None):
    """Item ``name`` of local ``step`` (``info``: its info under ``root``; None: this process has no copy)
    for ``process`` of a job of ``count``; without a copy, a ``Json`` item a peer shared at the
    restore (``shared``: {name: value}, :func:`json_items`). FileNotFoundError naming the step and
    process if there is no copy (lost with its local directory: a PerProcess value was only there;
    ``persistent``: the root that does not hold the step either); KeyError listing the copy's
    items; CheckpointError for a malformed item."""
    path = root.step_path(step)
    if info is None and shared and name in shared:
        return shared[name]
    if info is None:
        raise FileNotFoundError(f"step {step} is not committed in {persistent}, and process {process} has no "
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
    return items_lib.read(lambda key: location.read_file(ARRAYS + key), name, entry, step, process, count, path)[2]


SHARED_ITEM_BYTES = 1 << 20   # Json items shared through the coordination service at a restore, at most (in all)


def json_items(root: StepRoot, step: int, process: int, count: int) -> dict:
    """{name: value} of the ``Json`` items of this process's copy of local ``step`` -- the same in
    every copy --, for a peer without one: up to :data:`SHARED_ITEM_BYTES` of them as JSON (the
    coordination service carries small values); an item that cannot be read, or would go past
    that, is left out (logged: the peer's ``item()`` raises as for a lost copy)."""
    info = read_info(root, step)
    found, size = {}, 0
    for name, entry in (info or {}).get("items", {}).items():
        if isinstance(entry, dict) and entry.get("kind") == "json":
            try:
                value = read_item(root, step, info, name, process, count, root.display)
            except (CheckpointError, OSError, KeyError) as exc:
                logging.warning("dispatch_io: item %r of local step %s is not shared: %s", name, step, exc)
                continue
            nbytes = len(json.dumps(value))
            if size + nbytes > SHARED_ITEM_BYTES:
                logging.warning("dispatch_io: item %r of local step %s is not shared: the step's Json items pass "
                                "%d bytes", name, step, SHARED_ITEM_BYTES)
                continue
            found[name], size = value, size + nbytes
    return found


def update_info(root: StepRoot, step: int, fields: dict):
    """Record ``fields`` (its ``"agreed"``, ``"copies"``, ``"durability"``) in the info of this
    process's local ``step`` under ``root``, once the job agreed what it reached: a save records no
    more than its own commit proves. Written beside it and renamed over it, so a crash leaves the
    old info or the new one, never a torn one."""
    path = os.path.join(root.step_path(step), INFO)
    with open(path, "rb") as f:
        info = sealed.loads(f.read())
    info.update(fields)
    writing = path + ".writing"
    with open(writing, "wb") as f:
        f.write(sealed.dumps(info, allow_nan=False))
        f.flush()
        os.fsync(f.fileno())
    os.replace(writing, path)
