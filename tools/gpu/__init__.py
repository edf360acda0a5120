"""The GPU work in one place: slices of one device call each (``python -m tools.gpu``; docs/cluster.md,
section 5), the smoke list (``tools.gpu.smoke``), the offline wheelhouse (``tools/gpu/wheelhouse.py``),
the queue (``gpu_queue.yaml``) and the script for a node one holds (``session.sh``)."""
