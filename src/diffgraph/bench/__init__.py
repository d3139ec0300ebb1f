"""Benchmarks: latency and throughput against diffusers."""
