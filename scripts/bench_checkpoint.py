"""What checksums cost a checkpoint of a ~400M-parameter model (float32 weights and AdamW
moments, ~4.8 GB). Side effects: writes a random-weight model and checkpoints into --work.

    python scripts/bench_checkpoint.py [--work DIR] [--small]

Measured in one process, one rank, each save into a fresh directory:
- dcp_save_s: the reference, torch's own `torch.distributed.checkpoint.save` of the same model
  and optimizer state dicts (no fsync, no checksums);
- fnt_save_s: `fnt.checkpoint.save_checkpoint_`, the whole transaction (DCP files, checksums
  of every file, progress and config, fsync of everything, marker, rename);
- hash_s: hashing that checkpoint's files again right after the save, as the save does (they
  are in the page cache); its share of fnt_save_s is what checksums add to a save;
- verify_s and dcp_load_s: the check a resume makes before loading, against DCP's load.
The last line is one JSON object. `--small` uses the 2-layer benchmark model instead (seconds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def seconds(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=None, help="where models and checkpoints go")
    parser.add_argument("--small", action="store_true", help="the 2-layer model, for a quick run")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="fnt-bench-ckpt-"))
    work.mkdir(parents=True, exist_ok=True)

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from transformers import AutoModelForCausalLM

    from fnt.checkpoint import load_checkpoint_, save_checkpoint_
    from fnt.state import Progress
    from fnt.store.checksums import checkpoint_files, digests, share_problems
    from scripts.bench_memory import write_model

    model_dir = write_model(work / ("small" if args.small else "big"), big=not args.small)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # one step's moments, without the cost of a forward
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    params = sum(p.numel() for p in model.parameters())

    def reference_save() -> None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save(
            {"model": model_sd, "optim": optim_sd}, checkpoint_id=str(work / "dcp"), no_dist=True
        )

    root = work / "checkpoints"
    for path in (work / "dcp", root):
        shutil.rmtree(path, ignore_errors=True)
    dcp_save_s = seconds(reference_save)
    progress = Progress(step=1)
    fnt_save_s = seconds(
        lambda: save_checkpoint_(
            root, progress, model, optimizer, model_name=str(model_dir), rank=0, distributed=False
        )
    )
    saved = root / "step_1"
    files = checkpoint_files(saved)
    hash_s = seconds(lambda: digests(saved, files))
    size = sum((saved / name).stat().st_size for name in files)
    verify_s = seconds(lambda: share_problems(saved, 0, 1))
    dcp_load_s = seconds(lambda: load_checkpoint_(saved, model, optimizer, distributed=False))
    result = {
        "params": params,
        "checkpoint_bytes": size,
        "dcp_save_s": round(dcp_save_s, 3),
        "fnt_save_s": round(fnt_save_s, 3),
        "hash_s": round(hash_s, 3),
        "hash_share_of_save": round(hash_s / fnt_save_s, 4),
        "fnt_save_vs_dcp_save": round(fnt_save_s / dcp_save_s, 3),
        "verify_s": round(verify_s, 3),
        "dcp_load_s": round(dcp_load_s, 3),
        "hash_gb_per_s": round(size / hash_s / 1e9, 2),
    }
    print(
        f"checkpoint of {params / 1e6:.0f}M parameters, {size / 2**30:.2f} GiB: torch's DCP save "
        f"{dcp_save_s:.2f} s, fnt's transaction {fnt_save_s:.2f} s, of which hashing "
        f"{hash_s:.2f} s ({100 * hash_s / fnt_save_s:.1f}%); verifying {verify_s:.2f} s before "
        f"a load of {dcp_load_s:.2f} s"
    )
    print(json.dumps(result))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
