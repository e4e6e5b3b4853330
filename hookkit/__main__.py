"""`python -m hookkit ...`: the same command line as the `hookkit` console script."""

import sys

from hookkit.tools.cli import main

sys.exit(main())
