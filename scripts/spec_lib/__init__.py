"""Shared parts of the speculative-decoding benchmarks."""
