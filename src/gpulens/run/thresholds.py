"""Thresholds that more than one analysis uses, defined once."""

from __future__ import annotations

# A loop that waits on its data loader at least this share of its time is loader-bound: the
# stall breakdown then measures the fetch stall with a paired cold run, the read timers count,
# and the run summary's advice says the loader is the bottleneck.
LOADER_BOUND_DATA_WAIT = 0.20
