"""Kiln: an operator-fusion compiler for deep-learning inference."""
__version__ = "0.1.0"
