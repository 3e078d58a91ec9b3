"""``python -m common.preflight``: see cli.py."""

import sys

from common.preflight.cli import main

sys.exit(main())
