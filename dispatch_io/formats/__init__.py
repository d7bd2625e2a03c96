"""Other checkpoint formats, read as ours and written from ours.

* ``detect``: which format a path holds (ours, Orbax's, safetensors), opened as one ``Manifest``;
  ``metadata`` and the listing of a root's committed steps;
* ``orbax`` / ``safetensors``: readers that describe those formats as a ``Manifest``;
* ``convert``: a save whose source is stored checkpoint bytes (copy or convert into ours);
* ``exporting``: the export stream; ``to_safetensors`` / ``to_orbax``: its two writers.

May import the core packages (``plan``, ``manifest``, ``save``, ``read``, ``incremental``), ``storage``
and ``workers``; never ``multihost``, the API modules or ``manager`` (docs/design.md, "Layers").
"""
