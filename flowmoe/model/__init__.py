"""Reading a model: checkpoints, tensor map, weights, the numerics, tokenizer and chat templates."""
