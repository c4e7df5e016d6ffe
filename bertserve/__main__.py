"""`python -m bertserve ...`: the same as the `bertserve` command."""

import sys

from bertserve.cli import main

sys.exit(main())
