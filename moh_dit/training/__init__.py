"""Training: the config, the run folder and its checkpoints, the loop, and what it reports."""
