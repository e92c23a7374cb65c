"""The preset tokenizer and chat template (``weights/tokenizer.py``): ids inside the vocabulary, text
round trips, and ``save_random`` writes both so that a random checkpoint folder chats as a preset does."""

import json

import pytest

pytest.importorskip("tokenizers")

from ouro_jax.llm import load_tokenizer  # noqa: E402
from ouro_jax.server.chat_template import load_chat_template  # noqa: E402
from weights import save_random  # noqa: E402
from weights.config import PRESETS  # noqa: E402
from weights.tokenizer import SPECIALS, TEXT_TOKENS, preset_tokenizer  # noqa: E402

TEXT = 'user\nhi {"a": [1, 2.5], "b": "x y"}\t<think>why</think><tool_call>{}</tool_call>'


@pytest.mark.parametrize("preset", ["tiny", "ouro-small", "ouro-1.4b"])
def test_ids_fit_and_text_round_trips(preset):
    config = PRESETS[preset]
    tok = preset_tokenizer(config)
    ids = tok.encode("<|im_start|>" + TEXT + "<|im_end|>", add_special_tokens=False).ids
    assert max(ids) < config.vocab_size and tok.get_vocab_size() <= config.vocab_size
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.token_to_id("<|im_end|>")
    assert tok.decode(ids) == TEXT  # specials skipped, the think / tool-call tags kept
    for i, t in enumerate(SPECIALS + TEXT_TOKENS):
        assert tok.token_to_id(t) == i
    assert tok.token_to_id("<|endoftext|>") == config.eos_token_id


def test_byte_level_expresses_any_text():
    tok = preset_tokenizer(PRESETS["ouro-small"])
    s = "héllo wörld ✓ 日本 \U0001f600"
    assert tok.decode(tok.encode(s).ids) == s


def test_too_small_a_vocabulary_has_none():
    assert preset_tokenizer(PRESETS["tiny-gqa"]) is None


def test_save_random_writes_tokenizer_and_template(tmp_path):
    folder = save_random(tmp_path / "ck", "tiny", seed=0)
    tok = load_tokenizer(folder, PRESETS["tiny"])
    assert tok.decode(tok.encode(TEXT).ids) == TEXT
    template = load_chat_template(folder)
    assert template.special_tokens["eos_token"] == "<|im_end|>"
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    text = template.render(messages, tools=tools)
    assert json.dumps(tools[0]) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + call in text
    assert text.endswith("<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    want = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert template.render([{"role": "user", "content": "hi"}]) == want
