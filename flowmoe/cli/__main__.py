"""`python -m flowmoe.cli ...`: the `flowmoe` command without its installed script."""

import sys

from flowmoe.cli import main

sys.exit(main())
