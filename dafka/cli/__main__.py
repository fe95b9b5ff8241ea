"""``python -m dafka.cli``: the ``dafka`` command."""

import sys

from dafka.cli import main

sys.exit(main())
