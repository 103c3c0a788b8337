"""Models as single-device code (the GPT, the MLP, mixtures of experts, transformers causal LMs), the model
protocol, and their build on the meta device."""
