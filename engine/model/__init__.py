"""The model in plain torch: the decoder of the Llama family, attention over the paged KV cache,
the vision tower of a vision-language model, and batch-invariant mode's fixed-order ops and
recompute. Imports kernels only (and the root contracts)."""
