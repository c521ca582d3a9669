"""``python -m mpizero``: the command line (see ``mpizero.cli.main``)."""

import sys

from mpizero.cli.main import main

sys.exit(main())
