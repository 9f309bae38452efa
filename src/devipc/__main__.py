"""`python -m devipc`: the `devipc` command."""

import sys

from ._tools._cli import main

sys.exit(main())
