"""Incremental saves: storing only the chunks that changed since the newest committed step.

* ``changes``: which of this process's chunks changed (the base step, its digests), the batches
  left to write and what the manifest records for the rest;
* ``digests``: the chunk digests compared to tell changed chunks from unchanged ones;
* ``references``: the part of a manifest naming the steps that store unchanged chunks, read back
  when such a step is opened.

May import ``save`` (its sources, never its driver), ``plan``, ``manifest``, ``storage``,
``validate``, ``errors`` and ``workers``; never ``read``, ``formats``, ``multihost``, the API
modules or ``manager`` (docs/design.md, "Layers").
"""
