"""Measuring kernels: building blocks of a model alone, as probe artifacts a runner times.

This package sits above codegen and runtime (it generates and builds code); `kiln.profile`, which
the planner imports, only keeps and predicts latencies and never builds anything.
"""
