"""Shared by the structured-output tests: a character-level byte tokenizer (every byte is a token,
so any text is expressible) and a compiler for it with a model vocabulary larger than the
tokenizer's (ids 258.. are padding)."""

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_end|>"]
EOS_IDS = (0, 1)
MODEL_VOCAB = 300  # not a multiple of 32; 42 padding ids past the tokenizer's 258


def byte_tokenizer() -> Tokenizer:
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return byte_tokenizer()


@pytest.fixture(scope="session")
def compiler(tokenizer):
    from ouro_jax.structured import GrammarCompiler

    return GrammarCompiler(tokenizer, MODEL_VOCAB, EOS_IDS)
