"""Planning a save, pure: what is stored, which chunks are copied from which device by which
process, in which order and batches. No device data is touched and nothing is read or written.

* ``save_plan``: the job-wide save :class:`~dispatch_io.plan.save_plan.Plan` (leaf specs, chunks,
  packs of small leaves, region helpers such as ``device_regions``) and its cache;
* ``held``: the plan of a held save (``Dispatcher.save(own=True)``): what one process holds;
* ``batches``: chunks ordered by priority and packed into memory-budgeted batches;
* ``balance``: the least loaded of many candidates, picked again and again (``LeastLoaded``).

May import ``tree``, ``errors`` and ``workers`` only: every other part of the package plans
with it, and it calls none of them (docs/design.md, "Layers").
"""
