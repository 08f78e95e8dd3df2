"""Training data: image folders, Fashion-MNIST, packed latents and the rank-sharded batches."""
