"""Sampling: the settings (``SamplingSpec``), the pipeline (the denoising loop), loading weights from
anything a user has, N-sample generation and sample folders, model cards, and the demo.
"""
