"""Decode drivers: eager steps, CUDA-graph replay per device, sync inventory, checks."""
