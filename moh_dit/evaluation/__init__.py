"""Evaluation: features, reference statistics, the metrics and the scores of a sample set."""
