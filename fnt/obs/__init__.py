"""Observing a run: metrics, monitors, the console and the profiler. Metric groups and the one
host sync (metrics), the monitors that rows go to (monitors), what rank 0 prints (console) and
the profiler window (profiler). Side effects: printing (console), the monitors' files and W&B
calls (monitors), the profiler's trace files (profiler); metrics is pure but for reading the
disk usage and the peak memory; this file holds no code."""
