"""What fnt keeps on disk: the run directory, transactions, checksums and JSONL. The run
directory's names and decisions (rundir), directory transactions (transaction), checksums of
checkpoints, and strict JSONL reading (jsonl). Side effects: reading, writing, moving and
deleting files and directories (each module names which); the names and decisions of rundir and
best are pure; this file holds no code."""
