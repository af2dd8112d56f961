"""Studies: running a directory of configs resumably (`runner`, `python -m swarm study`), and the
paper-shaped report of their results (`report`, `python -m swarm report`): `runs` reads a run's
rows, `tables` and `plots` draw them, `findings` checks the paper's claims, `rerun` compares a row
re-run through the swarm with its single-process run."""
