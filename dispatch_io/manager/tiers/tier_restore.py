"""A restore through the tiers: gather what every process holds, plan (``placement``), fill.

:meth:`TierRestore.restore` gathers, in one named room, the regions each process's local steps hold,
plans with the pure ``placement.plan_restore`` and fills the target in at most two scale-out passes
(``tier_fill.Fill``): the local copies (each holder reads its own; the holders without one receive a
peer's), then the persistent step for the regions no process has. A process lost with its disk and
rebuilt from parity reads nothing in the local pass: its regions are rebuilt beside it, on a thread
of their own, the members of its groups giving what the pass reads of their copies as it lands
(nothing read twice), and it places them from memory (``rebuild``). Each byte of a local copy is read
once: what a process reads (its own regions, and the copies it reads for others) is checked against
the CRC-32Cs as it is read (``checks``), and a region that fails is filled again alone, from the next
source, for every process it was read for, in one more pass; only what cannot be checked in memory
is checked before the read. See docs/design.md "Tiers"."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading

import jax
from dispatch_io.read import loop as reading
from dispatch_io.read import targets as restore_lib
from dispatch_io.multihost import scaleout
from dispatch_io.manager.tiers import placement
from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.manager.tiers import checks, local_steps, rebuild
from dispatch_io.manager.tiers.tier_fill import Fill, Landed
from dispatch_io.progress import Progress


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
        self.shared_items: dict[int, dict] = {}   # {step: {name: value}}: Json items a peer shared (no copy here)

    def _copy(self, step: int, outputs_of) -> checks.LocalCopy:
        if step not in self._copies:
            self._copies[step] = checks.LocalCopy.open(self.root.step_path(step), outputs_of)
        return self._copies[step]

    def restore(self, target, infos: tuple[dict, list], persistent_steps, persistent_path, persistent_display: str, *,
                partial: bool = False, cast: bool = False, verify: bool = False, names=None, durability: str = "local",
                step=None):
        """Restore ``target`` (a pytree of ``jax.ShapeDtypeStruct`` / arrays with global shardings)
        from ``step`` (None: the newest step the tiers hold whole); every process calls it together. Returns
        (tree, :class:`~dispatch_io.manager.tiers.tier_fill.TierRestoreStats`): its ``step`` is the step the restore decided on.
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
        gathered = _gather(room, "held", self.process, {"held": held, "copies": copies, "parity": parity, "agreed": {
            str(s): local_steps.agreed(info) for s, info in infos.items()}})
        agreed = local_steps.agreed_steps({p: r["agreed"] for p, r in gathered.items()})   # the others: not whole
        gathered = {p: {key: {s: v for s, v in r[key].items() if s in agreed} for key in ("held", "copies", "parity",
                                                                                           "agreed")}
                    for p, r in gathered.items()}
        reports = {p: {int(s): placement.as_regions(h) for s, h in r["held"].items()} for p, r in gathered.items()}
        self._lost, self._sections = rebuild.augment(gathered, reports, self.count)   # what parity rebuilds
        if room is not None:
            persistent_steps, saved_as = room.from_leader("persistent"), room.from_leader("saved_as")
        if saved_as is None:
            saved_as = self._saved_keypaths(target, names, newest, persistent_steps, persistent_path)
        recorded: dict[int, int] = {}   # the fewest copies the infos that count record for each step
        for s in agreed:
            counted = placement.agreed_reports({p: {"copies": r["copies"][s], "agreed": r["agreed"][s]}
                                                for p, r in gathered.items() if s in r["copies"]})
            recorded[int(s)] = min(r["copies"] for r in counted)
        candidates = placement.eligible(durability, persistent_steps, recorded)
        if step is not None:
            candidates &= {step}
        wanted = {saved_as.get(k, k): v for k, v in placement.wanted_regions(target, self.count).items()}
        fill = Fill(self, target, saved_as, persistent_path, outputs_of, verify, room)
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

    def _plan_and_fill(self, fill: Fill, wanted: dict, reports: dict, persistent_steps, candidates: set):
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
            lost = self._lost.get(plan.step)
            later = lost is not None and _after_own_reads(plan, lost)   # rebuild from what the survivors read
            rebuilt_bad = {} if later else _counted(self._rebuild(plan.step, fill, reports), fill)[0]
            mine = reports[self.process].get(plan.step)
            copy = self._copy(plan.step, fill.outputs_of) if mine is not None and not (
                later and self.process in lost) else None
            if copy is not None and copy.opened is None:   # its copy cannot be opened: lost to this process
                bad = {k: [list(map(list, r)) for r in v] for k, v in mine.items()}
            else:
                bad = copy.bad(self.dispatcher, checks.before_read(plan, self.process, copy.by_keypath, mine)) \
                    if copy is not None else {}
            bad = _gather(fill.room, f"before{attempt}", self.process, {**bad, **rebuilt_bad})
            fill.failed.update(k for found in bad.values() for k in found)
            if _drop(reports, plan.step, bad):
                continue   # some copy the plan reads is bad: plan again without it
            if later:   # the rebuild runs beside the holders' reads of their own copies
                self.rebuilt[plan.step] = set(lost)
                reads = rebuild.read_ahead(lost, self._sections[plan.step], self.process,
                                           self.root.step_path(plan.step), self.dispatcher.runner)  # a holder's rows
                found = self._beside(plan, fill, reports, copy, lost, reads, todo is not wanted)
                if self.process in lost:   # it places its rebuilt regions
                    fill.place(plan, self._copies[plan.step], found)
            else:
                found = fill.run(plan, reports, copy, again=todo is not wanted)
            left_out = _gather(fill.room, f"after{attempt}", self.process, found)
            fill.failed.update(k for found in left_out.values() for k in found)
            if not _drop(reports, plan.step, left_out):
                return plan
            todo, allowed = _redo(todo, left_out, plan.routes), {plan.step}   # again, from the next source

    def _beside(self, plan: placement.TierPlan, fill: Fill, reports: dict, copy, lost, reads, again: bool) -> dict:
        """Fill ``plan`` with the rebuild of the ``lost`` processes running beside the local pass, on a
        thread of its own: the members read the regions their pieces are cut from first, and the
        rebuild takes each as soon as it is read and checked (``tier_fill.Landed``), so its rounds
        run while the pass reads the rest -- once the pass has run its own collectives (what travels
        from a peer's copy: ``rounds_over``), never at the same time. The lost processes, which read
        nothing of their own, get their rows meanwhile. {key path: [region]} of this process's
        regions left out (bad, or not rebuilt)."""
        room = fill.room   # the others wait for this process's rebuild there: its pass's reads are progress
        first = rebuild.feeding(self._sections[plan.step], lost, self.process)
        landed = Landed(None if room is None else
                        lambda read, told: room.set(f"progress/{self.process}", [plan.step, read, told]),
                        every=4.0 if room is None else room.timeout / 4, keep=first)
        gate = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="dispatch_io-rebuild") as pool:
            rebuilding = pool.submit(self._rebuild, plan.step, fill, reports, have=fill.in_memory(landed),
                                     reads=reads, gate=gate)
            try:
                found = fill.run(plan, reports, copy, again=again, defer=lost, landed=landed, first=first,
                                 rounds_over=gate.set)
            finally:   # the rebuild's waits end: what the pass did not read is read from the copy
                gate.set()
                landed.close()
            return _merged(found, _counted(rebuilding.result(), fill)[0])

    def _rebuild(self, step: int, fill: Fill, reports: dict, have=None, reads=None, gate=None) -> tuple[dict, int]:
        """Rebuild the regions lost processes hold at ``step`` through parity (``rebuild.run``: every
        process together, once per step; this process's rebuilt copy, if it is lost, becomes its copy;
        ``have``, ``reads``, ``gate``: as ``rebuild.run``'s). Returns ({key path: [region]} of its rebuilt regions
        that could not be rebuilt, the bytes it received: counted in ``fill``)."""
        lost = self._lost.pop(step, None)
        if lost is None:
            if reads is not None:
                reads.close()
            return {}, 0
        self.rebuilt[step] = set(lost)
        having = sorted(p for p, steps in reports.items() if step in steps and p not in lost)
        copy, bad, received = rebuild.run(step, lost, self._sections[step], having, fill.room, fill.outputs_of,
                                          process=self.process, step_path=self.root.step_path(step),
                                          runner=self.dispatcher.runner, have=have, reads=reads, gate=gate)
        if copy is not None:
            self._copies[step] = copy
        return bad, received

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

    def local_routes(self, by_leaf: list, defer=()):
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
                if self.process in route.own and region in out.regions and not travels and self.process not in defer:
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

    def fill_pass(self, reader, outputs: list, display: str, routes, verify: bool, check=None,
                  alone: bool = False, first=frozenset(), rounds_over=None) -> tuple[int, int]:
        """Fill the regions ``routes`` give this checkpoint (every process together; ``alone``: this
        process only, ``routes`` then giving the regions it reads itself); returns (bytes this process read into
        the result -- not counting a verify's reads -- bytes it received from others). ``check``: as
        ``scaleout.fill_outputs``, for what it reads of its copy."""
        options = self.dispatcher.options
        progress = Progress("restore", display, enabled=options.progress)
        try:
            with progress:
                if self.count > 1 and not alone:
                    received = scaleout.fill_outputs(reader, outputs, options, progress, verify=verify, times=[],
                                                     routes=routes, check=check, first=first,
                                                     rounds_over=rounds_over).useful
                else:  # nothing travels: its own regions are read as a restore reads them
                    received, mine = 0, routes if alone else (lambda index, out: routes(index, out)[1])
                    if verify:
                        reading.verify_outputs(reader, outputs, options.read_batch_bytes, progress, only=mine)
                    reading.read_outputs(reader, outputs, options.chunk_bytes, options.read_batch_bytes, progress,
                                         only=mine, check=check)
        finally:
            if reader is not None:
                reader.close()
        return sum(p.bytes_done for name, p in progress.phases.items() if name != "verify"), received


def _gather(room, phase: str, process: int, value) -> dict:
    """{process: value} of every process (through ``room``; alone: this one's)."""
    if room is None:
        return {process: value}
    room.set(f"{phase}/{process}", value)
    return room.gather(phase)


def _after_own_reads(plan: placement.TierPlan, lost) -> bool:
    """Whether the ``lost`` processes' regions can be rebuilt after the local pass, from what the
    others read in it: no region is read from a lost process's copy for another process."""
    return not any(route.parts or (route.kind == placement.PEER and route.reader in lost)
                   for regions in plan.routes.values() for route in regions.values())


def _counted(rebuilt: tuple[dict, int], fill: Fill) -> tuple[dict, int]:
    """``TierRestore._rebuild``'s result, its bytes received counted in ``fill`` (on the thread that fills)."""
    fill.received += rebuilt[1]
    return rebuilt


def _merged(a: dict, b: dict) -> dict:
    """{key path: [region]} of both."""
    found = {k: list(v) for k, v in a.items()}
    for keypath, regions in b.items():
        found.setdefault(keypath, []).extend(r for r in regions if r not in found[keypath])
    return found


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
