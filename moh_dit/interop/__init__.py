"""Interop: checkpoints of facebookresearch/DiT, SkyworkAI/MoH (MoH-DiT) and diffusers' DiT, both ways, and
turning a pretrained DiT into a MoH-DiT.
"""
