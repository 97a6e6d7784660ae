import sys

from chronomq.cluster.cli.commands import main

sys.exit(main())
