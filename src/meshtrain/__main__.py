"""``python -m meshtrain`` is the ``meshtrain`` command."""

import sys

from meshtrain.cli import main

sys.exit(main())
