"""python -m mgpu: the command line (see mgpu.cli)."""
import sys

from .cli import main

sys.exit(main())
