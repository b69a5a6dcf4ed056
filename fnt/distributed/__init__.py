"""The process layer: process group, devices, collectives and each rank's share. The process
group, devices and threads (runtime), the collectives, and each data-parallel rank's share of a
step's items (parallel; the plan of the parallel dimensions is fnt.config.parallel's). Side
effects: runtime's (the process group, threads, matmul precision) and the collectives'; parallel
is pure; this file holds no code."""
