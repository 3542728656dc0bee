"""``python -m jaxckpt``: the command line (see :mod:`jaxckpt._cli`)."""

import sys

from jaxckpt._cli.main import main

sys.exit(main())
