"""Measuring kernels on real hardware. This package sits above codegen and the runtime (it
generates and builds code); `kiln.profile`, which the planner imports, only keeps and predicts
latencies and builds nothing.

- `probe`: blocks of a model cut out and built side by side into one probe artifact, whose runner
  times every kernel (the service and device agents measure these);
- `harness`: candidate kernels of one block compiled into a shared library and timed in a child
  process on this CPU (the tuner, kiln.tune, measures with it).
"""
