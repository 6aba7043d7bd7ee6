"""Call op ``packed_attention``: a packed row's attention, sample by sample.

``packed`` holds ``Segments``, the dispatch over the op's chain and the hook into Hugging Face's
attention interface; ``native`` (a C kernel), ``pooled``, ``batched`` and ``sdpa`` are its
backends."""
