"""`python scripts/make_tiny_model.py ARGS...` is `fnt make-tiny-model ARGS...`."""

import sys

from fnt.__main__ import main

if __name__ == "__main__":
    main(["make-tiny-model", *sys.argv[1:]])
