"""The local tier of a training job (:class:`LocalTier`): fast steps on each host's own disk.

Pure plans first, then the runtime that uses them:

* ``placement``: what a local step records holding; where a restore reads each region (pure);
* ``replica_plan``: which peers keep copies of which regions (pure);
* ``parity_plan``: who keeps the XOR of whose pieces, and what a lost process is rebuilt from (pure);
* ``promote_plan``: a persistent step assembled from the local copies (pure);
* ``local_steps``: what this process's local steps hold on disk (plain values, no tier);
* ``job_steps``: what the job agrees about them (one gather per question);
* ``packed_rows``: packing shards of many leaves into rows that travel in one collective;
* ``replicas``: moving regions to the peers that keep their copies;
* ``parity``: making each process's parity rows on the devices at a local save;
* ``rebuild``: a lost process's regions rebuilt from its peers' copies and parity;
* ``rebuild_reads``: what a rebuild reads (checked as read) and the rebuilt copy it serves from memory;
* ``tier_restore``: a restore mixing the tiers (own copy, a peer's, persistent storage);
* ``tier_fill``: the passes that fill such a restore's result, and what it read;
* ``checks``: a restore's CRC-32C checks of local copies (in memory as they are read);
* ``promotion``: turning a local step into a persistent one without the devices;
* ``tier``: :class:`LocalTier` (the user's settings) and ``LocalTiers`` (its saves and steps).

May import the manager's lower modules (step_policies, items, info, retention, decisions), the API
modules, ``formats``, ``multihost``, the core, ``storage`` and ``workers``; only
``manager.manager`` imports it (docs/design.md, "Layers").
"""

from dispatch_io.manager.tiers.tier import LocalTier

__all__ = ["LocalTier"]
