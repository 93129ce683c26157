"""python -m mgpu: the command line (mgpu.commands.main)."""

import sys

from .commands.main import main

sys.exit(main())
