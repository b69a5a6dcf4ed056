"""`python scripts/rl.py ARGS...` is `fnt rl ARGS...` (see fnt/__main__.py)."""

import sys

from fnt.__main__ import main

if __name__ == "__main__":
    main(["rl", *sys.argv[1:]])
