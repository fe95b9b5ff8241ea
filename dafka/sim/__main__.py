"""``python -m dafka.sim``: see :mod:`dafka.sim.runner`."""

import sys

from dafka.sim.runner import main

sys.exit(main())
