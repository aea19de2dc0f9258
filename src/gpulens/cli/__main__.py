"""``python -m gpulens.cli ...``: the same as the ``gpulens`` console script."""

import sys

from gpulens.cli import main

sys.exit(main())
