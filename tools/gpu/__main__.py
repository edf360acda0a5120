"""``python -m tools.gpu list|carry|run|unpack|exec``: the GPU slices' command line (docs/cluster.md, 5)."""

import sys

from tools.gpu.cli import main

sys.exit(main())
