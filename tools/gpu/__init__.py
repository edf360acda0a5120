"""The GPU work in one place (docs/cluster.md).

Slices of one device call each, ``python -m tools.gpu list|carry|run|unpack`` (section 5), one
module per step of a slice's path: ``slices`` (the queue, ``gpu_queue.yaml``), ``carry``, ``run``
(with ``facts`` and ``report``), ``pack``, ``unpack``, ``ledger``; ``cli`` is the command line and
``tools/gpu_slice.sh`` the device call's one command. Besides: the smoke list (``tools.gpu.smoke``,
section 4), the offline wheelhouse (``wheelhouse.py``, section 1) and the script for a node one holds
(``session.sh``, section 6). Nothing is imported here: each module loads only what it needs.
"""
