import sys

from chronomq.cluster.cli import main

sys.exit(main())
