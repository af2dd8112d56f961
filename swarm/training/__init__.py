"""Training an experiment through any pipeline (swarm.engine.pipeline):

- `loop`: the training loop and evaluation, the same for one process and a swarm
- `experiment`: data, results files and the single-process run (`python -m swarm run`)
- `results`: JSON-lines results; `checkpoints`: a run's checkpoint directories
"""
