"""Checkpoint readers: find a checkpoint's files and read their headers (safetensors, torch zip,
config.json) without loading weights, then add up parameters and bytes per dtype (``estimate``).

A new file format gets its bounded reader here, beside ``safetensors_header`` and ``torch_zip``.
"""
