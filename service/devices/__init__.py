"""Devices that measure kernels (phones over adb, GPU hosts over ssh). Filled in by profiling."""
