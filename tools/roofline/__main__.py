"""`python -m tools.roofline ...`; see tools/roofline/cli.py."""

import sys

from .cli import main

sys.exit(main())
