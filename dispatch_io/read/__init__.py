"""Reading a checkpoint back into a target tree (restore) or against itself (verify).

* ``targets``: the restore target checked against the manifest, where and how each result leaf
  is built (``Output``), and building it from the filled host buffers;
* ``loop``: the pipelined read loop that restore and verify share on every runner, and what is
  read for each (regions, pieces, stored cells).

May import ``plan``, ``manifest``, ``progress``, ``storage``, ``tree``, ``errors`` and ``workers``;
never ``save``, ``incremental``, ``formats``, ``multihost``, the API modules or ``manager``
(docs/design.md, "Layers").
"""
