"""Soak, fault and load drivers: each module runs standalone (`python -m soak.NAME`) and writes
its figures as JSON under soak/results/; the fast versions run in `make test` (docs/reliability.md)."""
