"""The tokenizer and chat template of a random preset, built in code (no download), so that text
prompts and chat work without a real checkpoint; ``save_random`` writes the same into its folder.

``preset_tokenizer(config)``: a ``tokenizers.Tokenizer`` whose ids fit ``config.vocab_size``:

- ``vocab_size >= 264``: byte level (a BPE without merges over the 256 bytes), so any text and any
  JSON is expressible;
- ``vocab_size >= 105`` (``tiny``: 128): one token per printable ASCII character, newline and tab;
  other characters are ``<unk>``;
- smaller (``tiny-gqa``: 96): None.

Ids 0.. are the special tokens (``SPECIALS``): ``<|endoftext|>`` is 0, every preset's
``eos_token_id``, so a random model's end-of-sequence is unchanged; ``<|im_end|>`` ends a chat turn
and is the template's ``eos_token`` (``PRESET_TOKENIZER_CONFIG``), which the server adds to a chat
request's stop tokens. ``<think>``, ``</think>``, ``<tool_call>`` and ``</tool_call>`` are added
tokens that decode as text (not special), as in Qwen's tokenizers, so that the reasoning and
tool-call parsers see them.

``PRESET_CHAT_TEMPLATE``: ChatML as Ouro uses it (``<|im_start|>role\\ncontent<|im_end|>\\n``), with
tools as Qwen / Hermes templates render them: their JSON schemas inside ``<tools></tools>`` in the
system turn, an assistant's calls as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, a
tool's result as a ``tool`` turn.
"""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = [
    "PRESET_CHAT_TEMPLATE",
    "PRESET_TOKENIZER_CONFIG",
    "SPECIALS",
    "TEXT_TOKENS",
    "preset_tokenizer",
    "save_preset_tokenizer",
]

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")  # skipped when decoding
TEXT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")  # decoded as text
_CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
_N_ADDED = len(SPECIALS) + len(TEXT_TOKENS)

PRESET_CHAT_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures, within <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call a function, answer with a JSON object within <tool_call></tool_call>:\\n"
    '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if not (tools and loop.first and m['role'] == 'system') -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' -}}"
    "{%- if m['content'] -%}{{- m['content'] -}}{%- endif -%}"
    "{%- if m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] -%}"
    "{%- for tc in m['tool_calls'] -%}"
    "{%- set f = tc['function'] if tc['function'] is defined else tc -%}"
    "{%- if m['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (f['name'] | tojson) + ', \"arguments\": ' -}}"
    "{%- if f['arguments'] is string -%}{{- f['arguments'] -}}{%- else -%}{{- f['arguments'] | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# tokenizer_config.json of a random checkpoint (save_preset_tokenizer): what load_chat_template reads
PRESET_TOKENIZER_CONFIG = {
    "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>",
    "unk_token": "<unk>",
    "chat_template": PRESET_CHAT_TEMPLATE,
}


def preset_tokenizer(config):
    """The preset tokenizer for ``config.vocab_size`` (the module docstring), or None if it does not fit."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    n = config.vocab_size
    if n >= _N_ADDED + 256:
        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        vocab = {t: i for i, t in enumerate(SPECIALS + TEXT_TOKENS + tuple(alphabet))}
        tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
    elif n >= _N_ADDED + len(_CHARS):
        vocab = {t: i for i, t in enumerate(SPECIALS + TEXT_TOKENS + tuple(_CHARS))}
        tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
        tok.decoder = decoders.Fuse()
    else:
        return None
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_TOKENS])
    return tok


def save_preset_tokenizer(folder, config) -> Optional[str]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template) for ``config``
    into ``folder``; the tokenizer's path, or None when the vocabulary is too small for one."""
    tok = preset_tokenizer(config)
    if tok is None:
        return None
    path = os.path.join(folder, "tokenizer.json")
    tok.save(path)
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(PRESET_TOKENIZER_CONFIG, f, indent=1)
    return path
