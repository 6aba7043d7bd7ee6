"""LoRA layers as single autograd nodes: a linear layer (``linear``), a SwiGLU MLP of three
(``mlp``), and the q/k/v projections with the rotary embedding (``qkv``). Call ops
``lora_linear``, ``lora_mlp`` and ``lora_qkv`` in the registry."""
