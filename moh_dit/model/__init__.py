"""The research core: MoH attention, how it executes, the embedders, the network and its presets.

It imports nothing of the package but ``moh_dit.errors``.
"""
