"""Hugging Face Transformers in and out: `--init-from` a LlamaForCausalLM folder, `peer export`, `peer
generate` and tokenized data. Transformers itself (the `hf` extra) is imported only by the commands
that need it."""
