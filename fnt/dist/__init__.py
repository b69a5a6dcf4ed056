"""The process layer: process group, devices, collectives and each rank's share. The process
group, devices and threads (runtime), the collectives, and each data-parallel rank's share of a
step's items (parallel; the plan of the parallel dimensions is fnt.config.parallel's)."""
