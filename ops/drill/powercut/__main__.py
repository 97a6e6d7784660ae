"""``python -m ops.drill.powercut``: run the power-cut filesystem (see :mod:`.fuse`)."""

import sys

from chronomq.ops.drill.powercut.fuse import main

sys.exit(main())
