"""``python -m common.notebook execute|check NOTEBOOK.ipynb...`` (common/notebook/files.py)."""

import sys

from common.notebook.files import _main

sys.exit(_main(sys.argv[1:]))
