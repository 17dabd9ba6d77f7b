"""Shared parts of bench_step: timing steps on the stand-in device, the speculation row."""
