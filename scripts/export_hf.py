"""Export a checkpoint as a Hugging Face model directory.

python scripts/export_hf.py --checkpoint RUN/checkpoints/step_N --out HF_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fnt.export import export_hf
from fnt.model import DTYPES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="a complete step_N directory"
    )
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast the weights")
    args = parser.parse_args(argv)
    out = export_hf(args.checkpoint, args.out, args.dtype)
    print(json.dumps({"checkpoint": str(args.checkpoint), "out": str(out), "dtype": args.dtype}))


if __name__ == "__main__":
    main()
