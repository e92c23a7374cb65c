"""The chat template renders as Hugging Face's ``apply_chat_template`` would (jinja2 settings,
variables, errors), from each place a checkpoint may keep it."""

import json

import pytest

pytest.importorskip("jinja2")

from ouro_jax.server.chat_template import ChatTemplate, load_chat_template  # noqa: E402

# ChatML as Qwen/Ouro write it: block tags on their own lines, which trim_blocks / lstrip_blocks remove
CHATML = """{% for message in messages %}
    {% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are helpful.<|im_end|>
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

MESSAGES = [{"role": "user", "content": "Hi é"}, {"role": "assistant", "content": "Hello"}]


def test_chatml_renders_like_hugging_face():
    t = ChatTemplate(CHATML)
    want = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi é<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
    )
    assert t.render(MESSAGES, add_generation_prompt=False) == want
    assert t.render(MESSAGES) == want + "<|im_start|>assistant\n"


def test_variables_filters_and_errors():
    t = ChatTemplate(
        "{{ bos_token }}{{ messages[0] | tojson }}{% if messages | length > 1 %}{{ raise_exception('one only') }}"
        "{% endif %}{{ eos_token }}",
        {"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert t.render(MESSAGES[:1]) == '<s>{"role": "user", "content": "Hi é"}</s>'  # non-ASCII kept
    with pytest.raises(ValueError, match="one only"):
        t.render(MESSAGES)
    with pytest.raises(ValueError, match="chat template"):  # the sandbox refuses attribute tricks
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(MESSAGES)


def test_loading_from_a_folder(tmp_path):
    assert load_chat_template(tmp_path) is None  # no template: chat completions answer 400
    cfg = {
        "bos_token": {"content": "<s>", "special": True},  # a serialized AddedToken
        "eos_token": "</s>",
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert load_chat_template(tmp_path).render(MESSAGES) == "<s>D"
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "chat_template.jinja").write_text("{{ eos_token }}J")
    assert load_chat_template(tmp_path).render(MESSAGES) == "</s>J"
