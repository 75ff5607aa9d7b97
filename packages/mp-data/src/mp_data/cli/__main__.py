"""`python -m mp_data.cli ...`: the mp-data command without its installed script."""

import sys

from mp_data.cli import main

sys.exit(main())
