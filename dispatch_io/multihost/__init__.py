"""What a job of many processes adds: agreeing, committing once, reading each byte once.

* ``coordination``: named rooms on JAX's coordination service (gather, barrier, timeouts);
* ``commit``: agree on one plan, then commit once (one process or many);
* ``delivery``: which process reads which stored piece and whom it sends it to (pure);
* ``scaleout``: the restore that reads each stored byte once per job and sends the pieces;
* ``shared_verify``: a verify whose reads are split across the processes.

May import the core packages (``plan``, ``manifest``, ``save``, ``read``, ``incremental``), ``storage``
and ``workers``; never ``formats``, the API modules or ``manager`` (docs/design.md, "Layers").
"""
