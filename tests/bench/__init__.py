"""Benchmarks (`make bench`): they print medians, p99 and ratios; they are not tests and assert nothing."""
