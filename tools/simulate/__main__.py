"""`python -m tools.simulate ...`; see tools/simulate/cli.py."""

import sys

from .cli import main

sys.exit(main())
