"""Checkpoint integrity's cost, and a compilation cache in the run's bucket."""
