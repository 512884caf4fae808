"""``python -m vdcompile``: the vdcompile command line."""
import sys

from vdcompile.cli import main

sys.exit(main())
