"""What fnt keeps on disk: the run directory, transactions, checksums and JSONL. The run
directory's names and decisions (rundir), directory transactions (transaction), checksums of
checkpoints, and strict JSONL reading (jsonl)."""
