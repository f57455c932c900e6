"""Benchmarks: `make bench` (or `python -m bench [NAME ...]`) writes bench/results/NAME.json."""
