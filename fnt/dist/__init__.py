"""The process layer: the process group and device (runtime), collectives, and the plan of
data-parallel dimensions and each rank's share (parallel)."""
