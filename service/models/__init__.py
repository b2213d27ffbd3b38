"""Uploaded ONNX models: streamed to disk, validated by kiln's frontend, stored once by content."""
