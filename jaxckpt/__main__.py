"""``python -m jaxckpt``: the command line (see :mod:`jaxckpt._cli`)."""

import sys

from jaxckpt._cli import main

sys.exit(main())
