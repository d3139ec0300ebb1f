"""`python -m diffgraph ...`: the `diffgraph` command (cli.py)."""

import sys

from .cli import main

sys.exit(main())
