"""`python scripts/sft.py ARGS...` is `fnt sft ARGS...` (see fnt/__main__.py)."""

import sys

from fnt.__main__ import main

if __name__ == "__main__":
    main(["sft", *sys.argv[1:]])
