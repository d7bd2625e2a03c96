"""One restore through the tiers, filled pass by pass (``tier_restore`` plans and drives it).

:class:`Fill` holds the result's buffers and what was read: the local pass (each holder reads its
own copy, the others receive a peer's; processes rebuilt from parity place theirs after it,
:meth:`Fill.place`, rebuilt beside it from what the others read in it, :meth:`Fill.in_memory`), then the persistent
pass for the regions no local copy has. :class:`TierRestoreStats` is what it did.
"""

from __future__ import annotations

import dataclasses
import threading

import jax

from dispatch_io import tree as tree_lib
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.manager.tiers import checks, job_steps, local_steps, placement
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.read import targets as restore_lib
from dispatch_io.storage import Location
from dispatch_io.workers import ChunkError


@dataclasses.dataclass(frozen=True)
class TierRestoreStats:
    """What a restore through the tiers did, in this process: the step, how many regions came
    from a peer / persistent storage (job-wide), and the bytes this process read from its own
    local copy (a process rebuilt from parity: from its rebuilt copy, in memory), read from persistent
    storage, and received from other processes (a parity rebuild's rows too)."""

    step: int
    peer_regions: int
    persistent_regions: int
    bytes_read_local: int
    bytes_read_persistent: int
    bytes_received: int


class Fill:
    """The result of one restore through the tiers, filled pass by pass (:meth:`run`), and what it read."""

    def __init__(self, restore, target, saved_as: dict, persistent_path, outputs_of, verify: bool, room):
        self.restore, self.saved_as, self.persistent_path = restore, saved_as, persistent_path
        self.outputs_of, self.verify, self.room = outputs_of, verify, room
        self.leaves = [k for k, _ in tree_lib.flatten(target)[0]]
        self.read_local = self.read_persistent = self.received = self.peer_regions = self.persistent_regions = 0
        self.failed: set[str] = set()   # key paths of which a local copy failed its check (for messages)
        self.restart()

    def restart(self):
        """Forget the buffers filled so far (the restore goes on at another step); the counts stay."""
        self.step = self.treedef = self.outputs = self.described = None
        self.read_own: set = set()   # (saved key path, region) this process read of its own copy, local pass

    def run(self, plan: placement.TierPlan, reports: dict, copy: checks.LocalCopy | None, again: bool = False,
            defer=(), landed: "Landed | None" = None, first=frozenset(), rounds_over=None) -> dict:
        """Fill the regions ``plan`` routes (every process together): the local pass (if any region
        is read from a local copy: what each process reads of its copy checked as read), then the persistent pass (if a
        region needs it; verified with ``verify``, and when ``again``: regions whose local copy failed
        its check are not taken unchecked from the root either). ``reports``: what each process holds
        (who shares the step's manifest with the processes without a copy); ``defer``: processes that
        read none of their own regions in this pass (rebuilt from parity after it, :meth:`place`);
        ``landed``: told of each region of its own copy it reads, as it is checked (:class:`Landed`);
        ``first``: {(saved key path, region)} read before its other regions; ``rounds_over()``: called
        once the local pass has run its last collective (as ``scaleout.fill_outputs``'; a plan with
        regions from the root runs more after it: then not called). Returns
        {key path: [region]} of the own regions this process read that failed their check (left out)."""
        if plan.step != self.step:
            self.restart()
            self.step = plan.step
        by_leaf = self._by_leaf(plan)
        check = checks.ReadCheck(f"local step {plan.step} of {self.restore.path}", copy,
                                 reports[self.restore.process].get(plan.step))
        if any(r.own or r.kind == placement.PEER for regions in plan.routes.values() for r in regions.values()):
            self._local(plan, by_leaf, reports, copy, check if landed is None else landed.tap(check), defer, first,
                        None if plan.regions(placement.PERSISTENT) else rounds_over)
        if plan.regions(placement.PERSISTENT):
            self._persistent(plan, by_leaf, self.verify or again)
        self.peer_regions += plan.regions(placement.PEER)
        self.persistent_regions += plan.regions(placement.PERSISTENT)
        return check.bad

    def _by_leaf(self, plan: placement.TierPlan) -> list:
        """``plan``'s routes of each of the target's leaves, in order ({region: Route}; {} for none)."""
        return [plan.routes.get(self.saved_as.get(k, k), {}) for k in self.leaves]

    def _local(self, plan, by_leaf: list, reports: dict, copy, check, defer=(), first=frozenset(), rounds_over=None):
        restore = self.restore
        own = copy is not None and copy.opened is not None
        if self.described is None:  # a process without a copy plans with a peer's manifest, shared once per step
            having = sorted(p for p, steps in reports.items()
                            if plan.step in steps and p not in restore.rebuilt.get(plan.step, ()))
            shared = job_steps.share_manifest(
                self.room, plan.step, having, restore.process,
                lambda: Location.parse(restore.root.step_path(plan.step)).read_manifest()) if self.room else None
            self.described = copy.opened.manifest if own else parse_manifest(shared, restore.root.step_path(plan.step))
            if self.room and len(having) < restore.count and not plan.persisted:   # and its Json items (mgr.item)
                restore.shared_items[plan.step] = job_steps.share(
                    self.room, f"items/{plan.step}", f"the Json items of local step {plan.step}", having,
                    restore.process, lambda: local_steps.json_items(restore.root, plan.step, restore.process,
                                                                    restore.count))
        if self.outputs is None:
            self.treedef, self.outputs = (copy.treedef, copy.outputs) if own else self.outputs_of(self.described)
        reader = copy.open_reader(restore.dispatcher.runner) if own else None
        display = f"local step {plan.step} of {restore.template}"
        read, received = restore.fill_pass(reader, self.outputs, display,
                                           self._reading_own(restore.local_routes(by_leaf, defer)), False, check,
                                           first=first, rounds_over=rounds_over)
        self.read_local, self.received = self.read_local + read, self.received + received

    def _reading_own(self, routes):
        """``routes`` (``TierRestore.local_routes``'), noting in ``read_own`` the regions they give
        this process to read of its own copy (what :meth:`in_memory` may hand over)."""
        def noted(index, out):
            held, mine, may = routes(index, out)
            self.read_own.update((out.saved.keypath, region) for region in mine)
            return held, mine, may
        return noted

    def in_memory(self, landed: "Landed"):
        """``rebuild.run``'s ``have`` beside the local pass: a region of this process's copy that the
        pass read of it and checked (its host buffer, as stored), once it has landed in ``landed``
        (:class:`Landed`: the wait ends with the pass); None for one it did not read itself (a region
        received from a peer may miss a piece the peer's read found bad: not sent), one read as another
        dtype (``cast``) or of other bounds, or one that failed its check (it never lands)."""
        def have(keypath: str, stored: tuple):
            out, region, buffer = landed.wait(keypath, stored)
            if buffer is None or (keypath, region) not in self.read_own or \
                    buffer.shape != tuple(hi - lo for lo, hi in stored) or buffer.dtype != out.saved_dtype:
                return None
            return buffer
        return have

    def place(self, plan, copy: checks.LocalCopy, left_out: dict):
        """Read this process's own regions at ``plan.step`` from its copy rebuilt in memory (alone: no
        other process takes part), but those ``left_out`` ({key path: [region]}: not rebuilt)."""
        restore = self.restore
        by_leaf = self._by_leaf(plan)
        routes, skip = restore.local_routes(by_leaf), placement.as_regions(left_out)
        only = lambda index, out: [r for r in routes(index, out)[1]  # noqa: E731
                                   if r not in skip.get(out.saved.keypath, ())]
        read, _ = restore.fill_pass(copy.open_reader(restore.dispatcher.runner), self.outputs,
                                    f"local step {plan.step} of {restore.template}", only, False, alone=True)
        self.read_local += read

    def _persistent(self, plan, by_leaf: list, verify: bool):
        restore = self.restore
        opened = open_checkpoint(self.persistent_path(plan.step))
        reader = restore.dispatcher.runner.open_reader(opened.arrays, opened.context)
        treedef, outputs = self.outputs_of(opened.manifest)
        read, received = restore.fill_pass(reader, outputs, opened.display, restore.persistent_routes(by_leaf), verify)
        self.read_persistent, self.received = self.read_persistent + read, self.received + received
        opened.check_unchanged()
        if self.outputs is None:
            self.treedef, self.outputs = treedef, outputs
        else:
            for out, pout in zip(self.outputs, outputs):
                if isinstance(out, restore_lib.Output):
                    out.buffers.update(pout.buffers)

    def result(self):
        """(the restored tree, :class:`TierRestoreStats`)."""
        tree = jax.tree_util.tree_unflatten(self.treedef, [restore_lib.finish(o) for o in self.outputs])
        return tree, TierRestoreStats(self.step, self.peer_regions, self.persistent_regions, self.read_local,
                                      self.read_persistent, self.received)


class Landed:
    """The regions of its own copy a process's local pass has read and checked, as they land: a
    parity rebuild running beside the pass (``tier_restore``) takes its pieces from them as soon as
    they are there. :meth:`tap` wraps the pass's check; :meth:`close` (the pass is over) ends every wait.
    ``progress(regions read so far, waits told)``, if given, is told every ``every`` seconds while a
    wait goes on, whether the pass reads or not: the others wait for this process's rebuild at a
    barrier whose deadline only moves with progress, and a wait for a region the pass does not read
    (another mesh's) lasts the whole pass -- which, done reading, may itself wait at its last barrier
    for a slower process's reads. The wait ends when the pass does, and the pass's own waits have
    their timeouts: a wait here is never endless. ``keep``: {(saved key path, region)} the rebuild
    may take (None: all); only those are held here, so a region placed early is not kept from being
    freed."""

    def __init__(self, progress=None, every: float = 1.0, keep=None):
        self._found: dict = {}   # (saved key path, stored bounds) -> (output, region, array)
        self._done = threading.Condition()
        self._closed = False
        self._progress, self._every, self._keep = progress, every, keep
        self._read = self._told = 0   # regions the pass has read; the times ``progress`` was told

    def tap(self, check):
        """``check`` (``checks.ReadCheck``), noting each region it passes here."""
        def noted(out, region, array, *stored):
            passed = check(out, region, array, *stored)
            with self._done:
                self._read += 1
                if passed and not stored and not isinstance(array, ChunkError) and \
                        (self._keep is None or (out.saved.keypath, region) in self._keep):
                    self._found[(out.saved.keypath, out.stored_bounds(region))] = (out, region, array)
                self._done.notify_all()
            return passed
        return noted

    def close(self):
        """The pass is over: what has not landed will not."""
        with self._done:
            self._closed = True
            self._done.notify_all()

    def wait(self, keypath: str, stored: tuple) -> tuple:
        """(output, region, array) of the region of ``keypath`` at the stored bounds ``stored``, once it
        has landed; (None, None, None) if the pass ended without it."""
        key = (keypath, stored)
        while True:
            with self._done:
                self._done.wait_for(lambda: key in self._found or self._closed, self._every)
                if key in self._found or self._closed:
                    return self._found.get(key, (None, None, None))
                read, self._told = self._read, self._told + 1   # (``every`` s since the last look)
                told = self._told
            if self._progress is not None:   # outside the lock: the pass's taps go on meanwhile
                self._progress(read, told)
