"""Training an experiment through any pipeline: the loop, its schedule, results and checkpoints."""
