"""Harnesses that start real servers and clusters, for the tests, the benchmarks and the demo."""
