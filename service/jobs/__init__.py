"""Compile jobs and their artifacts: creation, the worker-side state machine, the API."""
