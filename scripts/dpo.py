"""`python scripts/dpo.py ARGS...` is `fnt dpo ARGS...` (see fnt/__main__.py)."""

import sys

from fnt.__main__ import main

if __name__ == "__main__":
    main(["dpo", *sys.argv[1:]])
