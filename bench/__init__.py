"""Benchmarks for Kiln and the model zoo they run on (see bench/zoo.py)."""
