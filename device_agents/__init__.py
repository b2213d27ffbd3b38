"""Kiln device agents: run generated kernels on real hardware and report their latencies.

    kiln-agent --config agent.toml

An agent discovers its devices (the local CPU, ssh hosts, adb phones over TCP or USB), reads each
device's hardware facts from the device itself (`facts`), registers them with the Kiln service,
heartbeats, claims measurement batches, and for each task pushes a content-addressed bundle (the
artifact's runner, weights and inputs) to the device, checks its hash there, runs it and uploads
the validated per-kernel latencies (`measure`). The HTTP contract lives in `protocol`; device
access behind one interface in `backends`.
"""
