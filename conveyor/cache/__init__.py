"""The paged KV cache: the pool of chunks (`pool`), the allocators that cut it into blocks and keep each
request's block tables (`allocator`), prefix caching (`prefix_cache`), offloading to host memory
(`offload`) and the pinned host/device copies these and the sampler use (`transfer`)."""
