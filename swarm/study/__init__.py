"""Studies: running a directory of configs resumably, and the paper-shaped report of their results."""
