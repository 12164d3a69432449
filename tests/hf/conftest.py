"""Small random Transformers Llama models made here (nothing is downloaded)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra (pip install -e '.[hf]') is not installed")

TEXT = (
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x\n"
    "        self.y = y\n\nfor i in range(10):\n    print(i, add(i, i))\n"
) * 40


def make_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on TEXT, with <s> and </s>, as a Transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", clean_up_tokenization_spaces=False
    )


def make_llama(path, *, tied: bool = True, kv_heads: int = 2, seed: int = 0, **overrides):
    """A random LlamaForCausalLM (grouped-query attention, tied embeddings by default, rope_theta and
    RMSNorm epsilon away from hivepipe's defaults) and its tokenizer, saved to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    kwargs = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=32,
        rope_theta=50000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**kwargs))
    with torch.no_grad():  # norms away from 1, so that a missed norm weight shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, tokenizer
