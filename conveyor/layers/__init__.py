"""The building blocks models are made of: attention over the paged cache (`attention`), the sampler,
dense linears (`linear`), quantized weights and their linears (`quantization/`, one table of formats
in `quantization.registry`), and the dtype and weight-format resolution (`precision`)."""
