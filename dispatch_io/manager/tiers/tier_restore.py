"""A restore through the tiers: gather what every process holds, plan (``placement``), fill.

:meth:`TierRestore.restore` gathers, in one named room, the regions each process's local steps hold,
plans with the pure ``placement.plan_restore`` and fills the target in at most two scale-out passes
(:class:`_Fill`): the local copies (each holder reads its own; the holders without one receive a
peer's), then the persistent step for the regions no process has. Each byte of a local copy is read
once: what a process reads (its own regions, and the copies it reads for others) is checked against
the CRC-32Cs as it is read (``checks``), and a region that fails is filled again alone, from the next
source, for every process it was read for, in one more pass; only what cannot be checked in memory
is checked before the read. See docs/design.md "Tiers"."""

from __future__ import annotations

import dataclasses
import functools

import jax
from dispatch_io.read import loop as reading
from dispatch_io.read import targets as restore_lib
from dispatch_io.multihost import scaleout
from dispatch_io.manager.tiers import placement
from dispatch_io import tree as tree_lib
from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.manager.tiers import checks, job_steps, local_steps, rebuild
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.progress import Progress
from dispatch_io.storage import Location


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


class NoWholeStep(FileNotFoundError):
    """No step (or not the one asked for) has every region of the target in any tier: the message
    says what was looked at (raised by every process alike)."""


class TierRestore:
    """One restore through the tiers, in this process: its local tier's steps under ``root`` (a
    ``StepRoot`` at ``path``; ``template``: the tier's path with ``{process}``, naming the job's room)
    read through ``dispatcher``, this process being ``process`` of ``count``. It calls nothing of
    the tier: what the restore decided is what it returns (:meth:`restore`)."""

    def __init__(self, dispatcher, root, path: str, template: str, process: int, count: int):
        self.dispatcher, self.root, self.path, self.template = dispatcher, root, path, template
        self.process, self.count = process, count
        self._copies: dict[int, checks.LocalCopy] = {}   # this process's copy of each step the plans picked
        self._lost, self._sections, self.rebuilt = {}, {}, {}   # parity: rebuild.augment's; {step: processes rebuilt}

    def _copy(self, step: int, outputs_of) -> checks.LocalCopy:
        if step not in self._copies:
            self._copies[step] = checks.LocalCopy.open(self.root.step_path(step), outputs_of)
        return self._copies[step]

    def restore(self, target, infos: tuple[dict, list], persistent_steps, persistent_path, persistent_display: str, *,
                partial: bool = False, cast: bool = False, verify: bool = False, names=None, durability: str = "local",
                step=None):
        """Restore ``target`` (a pytree of ``jax.ShapeDtypeStruct`` / arrays with global shardings)
        from ``step`` (None: the newest step the tiers hold whole); every process calls it together. Returns
        (tree, :class:`TierRestoreStats`): its ``step`` is the step the restore decided on.
        ``infos``: ({step: info} of this process's local steps, [their unreadable info files])
        (``local_steps.read_steps``). ``persistent_path(step)``: where the root holds a step.
        ``partial`` / ``cast`` / ``names``: as ``Dispatcher.restore``; local copies saved with checksums
        are always checked (``checks``: as they are read; a bad region is replaced by the next source),
        persistent ones with ``verify``, and always where the root replaces a bad local region
        (CorruptCheckpointError if it is bad there too).
        ``durability``: the weakest step it may pick (``placement.eligible``: ``"replicated"`` skips
        local steps some region of which had one copy; ``"persisted"`` picks a persistent step, read
        from local copies where they have it).
        ValueError without a target; :class:`NoWholeStep` (a FileNotFoundError) if no step has every region; BarrierTimeoutError
        naming a process that does not report within the barrier timeout."""
        if target is None:
            raise ValueError("a restore through the local tier needs a target with global shardings: they say "
                             "which process holds which region (restore(step, ...) reads the root without one)")
        placement.check_durability(durability)
        outputs_of = functools.partial(_outputs, target=target, partial=partial, cast=cast, names=names)
        infos, unreadable = infos
        held = {str(s): info["held"] for s, info in infos.items()}
        parity = {str(s): local_steps.parity_report(self.root, s, info) for s, info in infos.items()}
        copies = {str(s): placement.copies_of({**info, **parity[str(s)]}) for s, info in infos.items()}  # as durability=
        newest = max(infos, default=None)
        room = saved_as = None
        if self.count > 1:
            room = open_room("tiers", self.template, "the restore through the local tier",
                             self.dispatcher.options.barrier_timeout)
            if room.leader:  # one listing of the root, one reading of names=, for every process
                room.set("persistent", list(persistent_steps))
                room.set("saved_as", self._saved_keypaths(target, names, newest, persistent_steps, persistent_path))
        gathered = _gather(room, "held", self.process, {"held": held, "copies": copies, "parity": parity})
        reports = {p: {int(s): placement.as_regions(h) for s, h in r["held"].items()} for p, r in gathered.items()}
        self._lost, self._sections = rebuild.augment(gathered, reports, self.count)   # what parity rebuilds
        if room is not None:
            persistent_steps, saved_as = room.from_leader("persistent"), room.from_leader("saved_as")
        if saved_as is None:
            saved_as = self._saved_keypaths(target, names, newest, persistent_steps, persistent_path)
        recorded: dict[int, int] = {}   # the fewest copies any process's info records for each step
        for r in gathered.values():
            for s, n in r["copies"].items():
                recorded[int(s)] = min(n, recorded.get(int(s), n))
        candidates = placement.eligible(durability, persistent_steps, recorded)
        if step is not None:
            candidates &= {step}
        wanted = {saved_as.get(k, k): v for k, v in placement.wanted_regions(target, self.count).items()}
        fill = _Fill(self, target, saved_as, persistent_path, outputs_of, verify, room)
        plan = self._plan_and_fill(fill, wanted, reports, persistent_steps, candidates)
        if room is not None:  # not after a failure: the others may never come (the failure is what they raise)
            room.close()
        if plan is None:
            lost = f" (unreadable, so not used: {', '.join(unreadable)})" if unreadable else ""
            if step is not None and fill.failed:   # a copy was there: say why it was not used
                lost += (f"; the local copies of {', '.join(sorted(fill.failed))} at step {step} failed their CRC-32C "
                         "check or could not be read (logged)")
            which = (f"no step of {self.path} (or its peers') and {persistent_display} holds" if step is None else
                     f"at step {step}, neither {self.path} (nor its peers') nor {persistent_display} holds")
            raise NoWholeStep(f"{which} every region of the target{lost}" + (
                                        f" with durability {durability!r} or better" if durability != "local" else ""))
        return fill.result()

    def _plan_and_fill(self, fill: "_Fill", wanted: dict, reports: dict, persistent_steps, candidates: set):
        """Plan (``placement.plan_restore``), check what cannot be checked as it is read, fill; and
        again, every process alike, for the regions a bad copy left out (only those regions, from the
        next source, at the same step -- or, if none has them, everything at an older step). Returns
        the plan of the step filled, or None if no step has every region."""
        todo, allowed, attempt = wanted, candidates, 0
        while True:
            plan = placement.plan_restore(todo, reports, persistent_steps, allowed)
            if plan is None and todo is not wanted:  # the left-out regions have no other source at that step
                candidates, todo, allowed = candidates - {fill.step}, wanted, candidates - {fill.step}
                fill.restart()
                continue
            if plan is None:
                return None
            attempt += 1
            rebuilt_bad = self._rebuild(plan.step, fill, reports)
            mine = reports[self.process].get(plan.step)
            copy = self._copy(plan.step, fill.outputs_of) if mine is not None else None
            if copy is not None and copy.opened is None:   # its copy cannot be opened: lost to this process
                bad = {k: [list(map(list, r)) for r in v] for k, v in mine.items()}
            else:
                bad = copy.bad(self.dispatcher, checks.before_read(plan, self.process, copy.by_keypath, mine)) \
                    if copy is not None else {}
            bad = _gather(fill.room, f"before{attempt}", self.process, {**bad, **rebuilt_bad})
            fill.failed.update(k for found in bad.values() for k in found)
            if _drop(reports, plan.step, bad):
                continue   # some copy the plan reads is bad: plan again without it
            found = fill.run(plan, reports, copy, again=todo is not wanted)
            left_out = _gather(fill.room, f"after{attempt}", self.process, found)
            fill.failed.update(k for found in left_out.values() for k in found)
            if not _drop(reports, plan.step, left_out):
                return plan
            todo, allowed = _redo(todo, left_out, plan.routes), {plan.step}   # again, from the next source

    def _rebuild(self, step: int, fill: "_Fill", reports: dict) -> dict:
        """Rebuild the regions lost processes hold at ``step`` through parity (``rebuild.run``: every
        process together, once per step; this process's rebuilt copy, if it is lost, becomes its copy).
        {key path: [region]} of its rebuilt regions that could not be rebuilt."""
        lost = self._lost.pop(step, None)
        if lost is None:
            return {}
        self.rebuilt[step] = set(lost)
        having = sorted(p for p, steps in reports.items() if step in steps and p not in lost)
        copy, bad, received = rebuild.run(step, lost, self._sections[step], having, fill.room, fill.outputs_of,
                                          process=self.process, step_path=self.root.step_path(step),
                                          runner=self.dispatcher.runner)
        fill.received += received
        if copy is not None:
            self._copies[step] = copy
        return bad

    def _saved_keypaths(self, target, names, newest: int | None, persistent_steps, persistent_path) -> dict:
        """{target key path: the saved key path it reads} under ``names`` (``restore(names=...)``;
        {} without): steps record their regions by saved key path. Read from the manifest of this
        process's newest local step, else of the newest persistent step (one tree, alike in
        every process)."""
        paths = (([self.root.step_path(newest)] if newest is not None else []) +
                 ([persistent_path(max(persistent_steps))] if persistent_steps else []))
        if names is None or not paths:
            return {}
        try:
            manifest = open_checkpoint(paths[0]).manifest
        except (IncompleteCheckpointError, CorruptCheckpointError, OSError):  # a lost copy: the root's
            manifest = open_checkpoint(paths[-1]).manifest
        manifest = dataclasses.replace(manifest, tensor_names=names)
        found = {}
        for path, _ in jax.tree_util.tree_flatten_with_path(target)[0]:
            saved = manifest.saved_leaf(path, jax.tree_util.keystr(path))
            if saved is not None:
                found[jax.tree_util.keystr(path)] = saved.keypath
        return found

    def local_routes(self, by_leaf: list):
        """``scaleout.plan_split``'s routes of the local pass: each holder with a copy reads its
        own; for the others, the route's reader reads its copy and delivers it to them (a reader
        that does not hold the region receives its own piece too: one buffer it never uses), or,
        for a region cut from copies of other regions (``Route.parts``), a holder of each part
        reads that part's pieces."""
        def routes(index, out):
            held, mine, may = {}, [], {}
            for region, route in by_leaf[index].items():
                if route.parts:
                    held[region] = tuple(sorted(set(route.receivers).union(*(procs for _, procs in route.parts))))
                    may[region] = dict(route.parts)
                elif route.kind == placement.PEER:  # the reader (a holder or not) delivers it to the receivers
                    held[region] = tuple(sorted(set(route.receivers) | {route.reader}))
                    may[region] = (route.reader,)
                travels = self.process in held.get(region, ())  # a reader gets it with the others
                if self.process in route.own and region in out.regions and not travels:
                    mine.append(region)
            return held, mine, may
        return routes

    def persistent_routes(self, by_leaf: list):
        """The persistent pass's: the regions no holder has locally, as a scale-out restore reads them."""
        def routes(index, out):
            held, mine = {}, []
            for region, route in by_leaf[index].items():
                if route.kind != placement.PERSISTENT:
                    continue
                if len(route.receivers) > 1:
                    held[region] = route.receivers
                elif self.process in route.receivers:
                    mine.append(region)
            return held, mine, {}
        return routes

    def fill_pass(self, reader, outputs: list, display: str, routes, verify: bool, check=None) -> tuple[int, int]:
        """Fill the regions ``routes`` give this checkpoint (every process together); returns
        (bytes this process read into the result -- not counting a verify's reads -- bytes it
        received from others). ``check``: as ``scaleout.fill_outputs``, for what it reads of its copy."""
        options = self.dispatcher.options
        progress = Progress("restore", display, enabled=options.progress)
        try:
            with progress:
                if self.count > 1:
                    received = scaleout.fill_outputs(reader, outputs, options, progress, verify=verify, times=[],
                                                     routes=routes, check=check).useful
                else:  # one process: nothing travels, its own regions are read as a restore reads them
                    received, mine = 0, (lambda index, out: routes(index, out)[1])
                    if verify:
                        reading.verify_outputs(reader, outputs, options.read_batch_bytes, progress, only=mine)
                    reading.read_outputs(reader, outputs, options.chunk_bytes, options.read_batch_bytes, progress,
                                         only=mine, check=check)
        finally:
            if reader is not None:
                reader.close()
        return sum(p.bytes_done for name, p in progress.phases.items() if name != "verify"), received


class _Fill:
    """The result of one restore through the tiers, filled pass by pass (:meth:`run`), and what it read."""

    def __init__(self, restore: TierRestore, target, saved_as: dict, persistent_path, outputs_of, verify: bool, room):
        self.restore, self.saved_as, self.persistent_path = restore, saved_as, persistent_path
        self.outputs_of, self.verify, self.room = outputs_of, verify, room
        self.leaves = [k for k, _ in tree_lib.flatten(target)[0]]
        self.read_local = self.read_persistent = self.received = self.peer_regions = self.persistent_regions = 0
        self.failed: set[str] = set()   # key paths of which a local copy failed its check (for messages)
        self.restart()

    def restart(self):
        """Forget the buffers filled so far (the restore goes on at another step); the counts stay."""
        self.step = self.treedef = self.outputs = self.described = None

    def run(self, plan: placement.TierPlan, reports: dict, copy: checks.LocalCopy | None, again: bool = False) -> dict:
        """Fill the regions ``plan`` routes (every process together): the local pass (if any region
        is read from a local copy: what each process reads of its copy checked as read), then the persistent pass (if a
        region needs it; verified with ``verify``, and when ``again``: regions whose local copy failed
        its check are not taken unchecked from the root either). ``reports``: what each process holds
        (who shares the step's manifest with the processes without a copy). Returns {key path: [region]}
        of the own regions this process read that failed their check (left out)."""
        if plan.step != self.step:
            self.restart()
            self.step = plan.step
        by_leaf = [plan.routes.get(self.saved_as.get(k, k), {}) for k in self.leaves]
        check = checks.ReadCheck(f"local step {plan.step} of {self.restore.path}", copy,
                                 reports[self.restore.process].get(plan.step))
        if any(r.own or r.kind == placement.PEER for regions in plan.routes.values() for r in regions.values()):
            self._local(plan, by_leaf, reports, copy, check)
        if plan.regions(placement.PERSISTENT):
            self._persistent(plan, by_leaf, self.verify or again)
        self.peer_regions += plan.regions(placement.PEER)
        self.persistent_regions += plan.regions(placement.PERSISTENT)
        return check.bad

    def _local(self, plan, by_leaf: list, reports: dict, copy, check):
        restore = self.restore
        own = copy is not None and copy.opened is not None
        if self.described is None:  # a process without a copy plans with a peer's manifest, shared once per step
            shared = job_steps.share_manifest(
                self.room, plan.step, sorted(p for p, steps in reports.items()
                                             if plan.step in steps and p not in restore.rebuilt.get(plan.step, ())),
                restore.process,
                lambda: Location.parse(restore.root.step_path(plan.step)).read_manifest()) if self.room else None
            self.described = copy.opened.manifest if own else parse_manifest(shared, restore.root.step_path(plan.step))
        if self.outputs is None:
            self.treedef, self.outputs = (copy.treedef, copy.outputs) if own else self.outputs_of(self.described)
        reader = copy.open_reader(restore.dispatcher.runner) if own else None
        display = f"local step {plan.step} of {restore.template}"
        read, received = restore.fill_pass(reader, self.outputs, display, restore.local_routes(by_leaf), False, check)
        self.read_local, self.received = self.read_local + read, self.received + received

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


def _gather(room, phase: str, process: int, value) -> dict:
    """{process: value} of every process (through ``room``; alone: this one's)."""
    if room is None:
        return {process: value}
    room.set(f"{phase}/{process}", value)
    return room.gather(phase)


def _drop(reports: dict, step: int, bad: dict) -> bool:
    """Remove from ``reports`` (process -> {step: {key path: set of regions}}) the regions of ``step``
    each process found bad (``bad``: process -> {key path: [region as JSON]}); a process left with
    none of the step's regions no longer has the step. Whether any region was removed."""
    dropped = False
    for p, found in bad.items():
        held = reports.get(p, {}).get(step)
        if held is None:
            continue
        for keypath, regions in placement.as_regions(found).items():
            if regions & held.get(keypath, set()):
                held[keypath] = held[keypath] - regions
                dropped = True
        if not any(held.values()):
            del reports[p][step]
    return dropped


def _redo(todo: dict, left_out: dict, routes: dict) -> dict:
    """{key path: {region: the processes that fill it again}} of ``todo`` (what a pass fills again),
    from ``left_out`` (process -> {key path: [region as JSON]}, what each found bad in its copy) and
    the pass's ``routes``: a holder that left its own region out, and the receivers of a region its
    peer route's reader found bad (the reader did not send it)."""
    found = {p: placement.as_regions(regions) for p, regions in left_out.items()}
    redo: dict = {}
    for keypath, regions in todo.items():
        for region, holders in regions.items():
            bad = {p for p, held in found.items() if region in held.get(keypath, ())}
            route = routes.get(keypath, {}).get(region)
            sent_bad = route is not None and route.reader in bad
            who = tuple(p for p in holders if p in bad or (sent_bad and p in route.receivers))
            if who:
                redo.setdefault(keypath, {})[region] = who
    return redo


def _outputs(manifest, *, target, partial: bool, cast: bool, names):
    """``restore.plan_outputs`` of ``target`` as ``Dispatcher.restore(partial=, cast=, names=)`` plans it."""
    if names is not None:
        manifest = dataclasses.replace(manifest, tensor_names=names)
    return restore_lib.plan_outputs(manifest, target, partial, cast)
