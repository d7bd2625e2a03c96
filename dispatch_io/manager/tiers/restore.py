"""A restore through the tiers: gather what every process holds, plan (``tiers_plan``), fill.

:meth:`TierRestore.restore` gathers, in one named room, the regions each process's usable local
steps hold (the newest checked chunk by chunk against its CRC-32C first), plans with the pure
``tiers_plan.plan_restore`` and fills the target in at most two scale-out passes: the local copies
(each holder reads its own; the holders without one receive a peer's), then the persistent step
for the regions no process has. See docs/design.md "Tiers".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
from absl import logging

from dispatch_io import reading
from dispatch_io import restore as restore_lib
from dispatch_io.multihost import scaleout
from dispatch_io.manager.tiers import plan as tiers_plan
from dispatch_io import tree as tree_lib
from dispatch_io.multihost.coordination import open_room
from dispatch_io.errors import CorruptCheckpointError, IncompleteCheckpointError, WorkerError
from dispatch_io.formats.detect import open_checkpoint
from dispatch_io.manager.tiers import local_steps
from dispatch_io.manifest import parse as parse_manifest
from dispatch_io.progress import Progress
from dispatch_io.storage import Location


@dataclasses.dataclass(frozen=True)
class TierRestoreStats:
    """What a restore through the tiers did, in this process: the step, how many regions came
    from a peer / persistent storage (job-wide), and the bytes this process read from its own
    local copy, read from persistent storage, and received from other processes."""

    step: int
    peer_regions: int
    persistent_regions: int
    bytes_read_local: int
    bytes_read_persistent: int
    bytes_received: int


class TierRestore:
    """One restore through the tiers of a :class:`~dispatch_io.manager.tiers.tier.LocalTiers` (this process's)."""

    def __init__(self, local):
        self.local, self.tier, self.dispatcher = local, local.tier, local.dispatcher
        self.process, self.count, self.path, self._root = local.process, local.count, local.path, local.root
        self._infos = local.infos
        self._own = None   # the newest local step's own regions, checked first (``_held``)

    def _held(self, outputs_of) -> tuple[dict, dict, int | None, list[str]]:
        """({step: {key path: [region, ...]}} of this process's usable local steps -- the newest
        without the regions whose chunks fail their CRC-32C --, {step: its recorded copies}, the
        step so checked, [the info files that could not be read])."""
        infos, unreadable = self._infos()
        held = {str(step): info["held"] for step, info in infos.items()}
        # the copies each step recorded (one where it recorded none or nonsense: the weakest durability)
        copies = {str(step): info["copies"] if type(info.get("copies")) is int and info["copies"] >= 1 else 1
                  for step, info in infos.items()}
        if not infos:
            return held, copies, None, unreadable
        newest = max(infos)
        own = infos[newest].get("sharded")   # its own regions: the replicas it keeps are checked if read
        self._own = own if isinstance(own, dict) else None
        self._check(newest, held, outputs_of, self._own)
        return held, copies, newest, unreadable

    def _check(self, step: int, held: dict, outputs_of, only: dict | None = None):
        """Check local ``step``'s copy (in ``held``, {step: its regions}) against its CRC-32Cs --
        ``only`` those regions, if given (the others stay reported, unchecked) --: keep only its
        intact regions, or drop it if it cannot be read (logged) -- lost to this process, as a
        wiped step is: a peer's copy or the root serves."""
        regions = held[str(step)]
        checked = regions if only is None else {k: [r for r in v if r in only.get(k, ())] for k, v in regions.items()}
        try:
            intact = self._intact(step, checked, outputs_of)
        except (IncompleteCheckpointError, CorruptCheckpointError, WorkerError, OSError) as exc:
            logging.warning("dispatch_io: the local step %s is not used: %s", self._root.step_path(step), exc)
            del held[str(step)]
            return
        held[str(step)] = {k: intact.get(k, []) + [r for r in v if r not in checked.get(k, ())]
                           for k, v in regions.items()}

    def _intact(self, step: int, held: dict, outputs_of) -> dict:
        """``held`` (of local ``step``) without the regions a chunk of which fails its CRC-32C
        (logged): the restore then plans them from the next source, a peer's copy or persistent
        storage. A step saved without checksums is returned as it is (nothing to check against)."""
        opened = open_checkpoint(self._root.step_path(step))
        if not opened.manifest.has_checksums:
            return held
        _, outputs = outputs_of(opened.manifest)
        reader = self.dispatcher.runner.open_reader(opened.arrays, opened.context)
        progress = Progress("verify", opened.display, enabled=False)
        intact = {}
        try:
            with progress:
                for out in outputs:
                    if not isinstance(out, restore_lib.Output) or out.saved.keypath not in held:
                        continue
                    intact[out.saved.keypath] = []
                    for region in held[out.saved.keypath]:
                        bounds = out.stored_bounds(tuple(tuple(b) for b in region))
                        try:
                            reading.verify_stored(reader, [(out, bounds)], self.dispatcher.options.read_batch_bytes,
                                                  progress)
                        except CorruptCheckpointError as exc:
                            logging.warning("dispatch_io: the local copy is not used: %s", exc)
                            continue
                        intact[out.saved.keypath].append(region)
        finally:
            reader.close()
        return intact

    def restore(self, target, persistent_steps, persistent_path, persistent_display: str, *, partial: bool = False,
                cast: bool = False, verify: bool = False, names=None, durability: str = "local", step=None):
        """Restore ``target`` (a pytree of ``jax.ShapeDtypeStruct`` / arrays with global shardings)
        from ``step`` (None: the newest step the tiers hold whole); every process calls it together. Returns
        (tree, :class:`TierRestoreStats`). ``persistent_path(step)``: where the root holds a step.
        ``partial`` / ``cast`` / ``names``: as ``Dispatcher.restore``; local copies saved with checksums
        are always checked (a bad one is replaced by the next source), persistent ones with ``verify``.
        ``durability``: the weakest step it may pick (``tiers_plan.eligible``: ``"replicated"`` skips
        local steps some region of which had one copy; ``"persisted"`` picks a persistent step, read
        from local copies where they have it).
        Then local saves go on after the step on every process, and the first save deletes the newer
        local steps (``LocalTiers.resume``).
        ValueError without a target; FileNotFoundError if no step has every region; BarrierTimeoutError
        naming a process that does not report within the barrier timeout."""
        if target is None:
            raise ValueError("a restore through the local tier needs a target with global shardings: they say "
                             "which process holds which region (restore(step, ...) reads the root without one)")
        tiers_plan.check_durability(durability)
        options = self.dispatcher.options
        outputs_of = functools.partial(_outputs, target=target, partial=partial, cast=cast, names=names)
        held, copies, verified, unreadable = self._held(outputs_of)  # before the room: a long verify must not
        checked: set[int] = set()  # steps whose regions this process checked, all (its own: the newest)
        room = saved_as = None
        if self.count > 1:
            room = open_room("tiers", self.tier.process_path("{process}"), "the restore through the local tier",
                             options.barrier_timeout)
            if room.leader:  # one listing of the root, one reading of names=, for every process
                room.set("persistent", list(persistent_steps))
                room.set("saved_as", self._saved_keypaths(target, names, verified, persistent_steps, persistent_path))
        for attempt in itertools.count():  # again while the plan picks a step some holder has not checked
            report = {"held": held, "copies": copies if attempt == 0 else {}, "checked": sorted(checked),
                      "own": verified}
            if room is not None:
                room.set(f"held{attempt}/{self.process}", report)
            gathered = room.gather(f"held{attempt}") if room else {self.process: report}
            reports = {p: {int(s): tiers_plan.as_regions(h) for s, h in r["held"].items()} for p, r in gathered.items()}
            if attempt == 0:  # what does not change between attempts
                if room is not None:
                    persistent_steps, saved_as = room.from_leader("persistent"), room.from_leader("saved_as")
                if saved_as is None:
                    saved_as = self._saved_keypaths(target, names, verified, persistent_steps, persistent_path)
                recorded: dict[int, int] = {}   # the fewest copies any process's info records for each step
                for r in gathered.values():
                    for s, n in r["copies"].items():
                        recorded[int(s)] = min(n, recorded.get(int(s), n))
                candidates = tiers_plan.eligible(durability, persistent_steps, recorded)
                if step is not None:
                    candidates &= {step}
                wanted = {saved_as.get(k, k): v for k, v in tiers_plan.wanted_regions(target, self.count).items()}
            plan = tiers_plan.plan_restore(wanted, reports, persistent_steps, candidates)
            # with every region read by its own holders, the newest step's own regions were checked
            own_only = plan is not None and all(r.kind is None for rs in plan.routes.values() for r in rs.values())
            if plan is None or not any(str(plan.step) in r["held"] and plan.step not in r["checked"]
                                       and not (own_only and plan.step == r["own"]) for r in gathered.values()):
                break
            if str(plan.step) in held and plan.step not in checked:  # what is still unchecked of the step
                done = self._own if plan.step == verified and self._own is not None else {}
                self._check(plan.step, held, outputs_of, {k: [r for r in v if r not in done.get(k, ())]
                                                          for k, v in held[str(plan.step)].items()})
            checked.add(plan.step)
        local_pass = plan is not None and any(r.own or r.kind == tiers_plan.PEER
                                              for regions in plan.routes.values() for r in regions.values())
        shared = local_steps.share_manifest(  # for a process without the step: it plans with a peer's manifest
            room, plan.step, sorted(p for p, steps in reports.items() if plan.step in steps), self.process,
            lambda: Location.parse(self._root.step_path(plan.step)).read_manifest()) if local_pass and room else None
        if room is not None:
            room.close()
        if plan is None:
            if step is None:  # the job starts afresh: local saves from step 0 on, on every process alike
                self.local.resume(None)
            lost = f" (unreadable, so not used: {', '.join(unreadable)})" if unreadable else ""
            which = (f"no step of {self.path} (or its peers') and {persistent_display} holds" if step is None else
                     f"at step {step}, neither {self.path} (nor its peers') nor {persistent_display} holds")
            raise FileNotFoundError(f"{which} every region of the target{lost}" + (
                                        f" with durability {durability!r} or better" if durability != "local" else ""))
        local_verify = verify  # every local copy of the step was checked against its CRC-32Cs above
        own_copy = plan.step in reports[self.process]  # as reported: a copy it could not read is not its own
        # each result leaf's routes, by its index (a leaf read under another name, names=, too)
        by_leaf = [plan.routes.get(saved_as.get(k, k), {}) for k, _ in tree_lib.flatten(target)[0]]
        result = self._fill(plan, by_leaf, persistent_path, local_pass, own_copy, shared, local_verify, verify,
                            outputs_of)
        self.local.resume(plan.step)
        return result

    def _saved_keypaths(self, target, names, newest: int | None, persistent_steps, persistent_path) -> dict:
        """{target key path: the saved key path it reads} under ``names`` (``restore(names=...)``;
        {} without): steps record their regions by saved key path. Read from the manifest of this
        process's newest local step, else of the newest persistent step (one tree, alike in
        every process)."""
        paths = (([self._root.step_path(newest)] if newest is not None else []) +
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

    def _fill(self, plan: tiers_plan.TierPlan, by_leaf: list, persistent_path, local_pass: bool, own_copy: bool,
              shared, local_verify: bool, verify: bool, outputs_of):
        """The local pass (if any region is read from a local copy), then the persistent pass (if a
        region needs it); their buffers joined, the result finished. ``by_leaf``: the plan's routes of
        each target leaf, in order. ``shared``: the step's manifest for a process without a copy of its own."""
        read_local = read_persistent = received = 0
        outputs = None
        if local_pass:
            step_path = self._root.step_path(plan.step)
            reader, described = None, None
            if own_copy:  # its own manifest: it has the checksums of its own chunks
                opened = open_checkpoint(step_path)
                reader = self.dispatcher.runner.open_reader(opened.arrays, opened.context)
                described = opened.manifest
            display = f"local step {plan.step} of {self.tier.process_path('{process}')}"
            described = described or parse_manifest(shared, step_path)
            treedef, outputs = outputs_of(described)
            local_verify = local_verify and described.has_checksums  # a step saved without them: nothing to check
            read_local, received = self._pass(reader, outputs, display, self._local_routes(by_leaf), local_verify)
        if plan.regions(tiers_plan.PERSISTENT):
            opened = open_checkpoint(persistent_path(plan.step))
            reader = self.dispatcher.runner.open_reader(opened.arrays, opened.context)
            ptreedef, poutputs = outputs_of(opened.manifest)
            read_persistent, got = self._pass(reader, poutputs, opened.display, self._persistent_routes(by_leaf),
                                              verify)
            received += got
            opened.check_unchanged()
            if outputs is None:
                treedef, outputs = ptreedef, poutputs
            else:
                for out, pout in zip(outputs, poutputs):
                    if isinstance(out, restore_lib.Output):
                        out.buffers.update(pout.buffers)
        tree = jax.tree_util.tree_unflatten(treedef, [restore_lib.finish(o) for o in outputs])
        return tree, TierRestoreStats(plan.step, plan.regions(tiers_plan.PEER), plan.regions(tiers_plan.PERSISTENT),
                                      read_local, read_persistent, received)

    def _local_routes(self, by_leaf: list):
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
                elif route.kind == tiers_plan.PEER:  # the reader (a holder or not) delivers it to the receivers
                    held[region] = tuple(sorted(set(route.receivers) | {route.reader}))
                    may[region] = (route.reader,)
                travels = self.process in held.get(region, ())  # a reader gets it with the others
                if self.process in route.own and region in out.regions and not travels:
                    mine.append(region)
            return held, mine, may
        return routes

    def _persistent_routes(self, by_leaf: list):
        """The persistent pass's: the regions no holder has locally, as a scale-out restore reads them."""
        def routes(index, out):
            held, mine = {}, []
            for region, route in by_leaf[index].items():
                if route.kind != tiers_plan.PERSISTENT:
                    continue
                if len(route.receivers) > 1:
                    held[region] = route.receivers
                elif self.process in route.receivers:
                    mine.append(region)
            return held, mine, {}
        return routes

    def _pass(self, reader, outputs: list, display: str, routes, verify: bool) -> tuple[int, int]:
        """Fill the regions ``routes`` give this checkpoint (every process together); returns
        (bytes this process read into the result -- not counting a verify's reads -- bytes it
        received from others)."""
        options = self.dispatcher.options
        progress = Progress("restore", display, enabled=options.progress)
        try:
            with progress:
                if self.count > 1:
                    received = scaleout.fill_outputs(reader, outputs, options, progress, verify=verify, times=[],
                                                     routes=routes).useful
                else:  # one process: nothing travels, its own regions are read as a restore reads them
                    received, mine = 0, (lambda index, out: routes(index, out)[1])
                    if verify:
                        reading.verify_outputs(reader, outputs, options.read_batch_bytes, progress, only=mine)
                    reading.read_outputs(reader, outputs, options.chunk_bytes, options.read_batch_bytes, progress,
                                         only=mine)
        finally:
            if reader is not None:
                reader.close()
        return sum(p.bytes_done for name, p in progress.phases.items() if name != "verify"), received


def _outputs(manifest, *, target, partial: bool, cast: bool, names):
    """``restore.plan_outputs`` of ``target`` as ``Dispatcher.restore(partial=, cast=, names=)`` plans it."""
    if names is not None:
        manifest = dataclasses.replace(manifest, tensor_names=names)
    return restore_lib.plan_outputs(manifest, target, partial, cast)
