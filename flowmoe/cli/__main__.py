"""`python -m flowmoe.cli`: the same as the `flowmoe` command."""

import sys

from flowmoe.cli import main

sys.exit(main())
