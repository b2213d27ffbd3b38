"""Measured kernel latencies per device (the shared profiling database). Filled in by profiling."""
