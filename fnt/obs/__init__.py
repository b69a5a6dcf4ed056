"""Observing a run: metrics, monitors, the console and the profiler. Metric groups and the one
host sync (metrics), the monitors that rows go to (monitors), what rank 0 prints (console) and
the profiler window (profiler)."""
