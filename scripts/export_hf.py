"""`python scripts/export_hf.py ARGS...` is `fnt export ARGS...` (see fnt/__main__.py)."""

import sys

from fnt.__main__ import main

if __name__ == "__main__":
    main(["export", *sys.argv[1:]])
