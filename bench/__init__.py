"""Benchmarks: each prints ratios measured in one run and appends them to bench/RESULTS.md."""
