"""``python -m dcp_tiered.cli``: the ``dcp-tiered`` command."""

import sys

from . import main

sys.exit(main())
