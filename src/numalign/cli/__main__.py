"""python -m numalign.cli: the numalign command line."""

import sys

from numalign.cli import main

sys.exit(main())
