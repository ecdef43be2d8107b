"""Quantized weights: the block formats (`tensors`), the linears and embeddings over them (`linear`), and
the table of `quantization=` formats (`registry`)."""
