"""Observing a run: metrics, monitors, the console and the profiler. Metric groups and the one
host sync (metrics), the monitors that rows go to (monitors: the JSONL file, W&B and the console's
line per step), what rank 0 prints at start-up and at the end (console) and the profiler window
(profiler). Side effects: printing (console, monitors), the monitors' files and W&B calls
(monitors), the profiler's trace files (profiler); metrics is pure but for reading the disk
usage and the peak memory; this file holds no code."""
