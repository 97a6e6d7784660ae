import sys

from chronomq.cli import main

sys.exit(main())
