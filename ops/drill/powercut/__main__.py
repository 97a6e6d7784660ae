"""``python -m ops.drill.powercut``: run the power-cut filesystem (see :mod:`.fuse`)."""

import sys

from ops.drill.powercut.fuse import main

sys.exit(main())
