"""Running a save: from planned batches to a committed checkpoint.

* ``job``: what a save is given (``SaveJob``, ``Attachments``), plain data;
* ``driver``: the save driver (``SaveRun``), one thread per save walking the batches, and what a
  save returns (``SaveHandle``);
* ``finish``: the end of a save: the processes agree, the leader writes the manifest, it commits;
* ``sources``: where each chunk's bytes are (the shards of the leaves being saved);
* ``staging``: the host staging ring, the memory budget of the copies in flight;
* ``transfer``: device -> host copies of one batch (pageable and pinned paths).

May import ``plan``, ``manifest``, ``progress``, ``storage``, ``collector``, ``tree``, ``errors``
and ``workers``; never ``read``, ``incremental``, ``formats``, ``multihost``, the API modules or
``manager`` (docs/design.md, "Layers").
"""
