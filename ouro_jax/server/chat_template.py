"""The checkpoint's chat template, rendered the way Hugging Face's ``apply_chat_template`` does.

Same jinja2 environment as ``transformers`` (sandboxed, ``trim_blocks``, ``lstrip_blocks``,
``loopcontrols``, a ``tojson`` that keeps non-ASCII, ``raise_exception``, ``strftime_now``) and the
same variables (``messages``, ``add_generation_prompt`` and the special tokens of
``tokenizer_config.json``), so that a prompt renders to the text the model was trained on.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Optional

__all__ = ["ChatTemplate", "chat_template_of", "load_chat_template"]

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(v) -> Optional[str]:
    """A special token as tokenizer_config.json stores it: a string or a serialized AddedToken."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    def __init__(self, template: str, special_tokens: Optional[dict[str, str]] = None):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        self.source = template
        self._template = env.from_string(template)
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text; a template error (``raise_exception`` included) raises ``ValueError``."""
        import jinja2

        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens, **kwargs
            )
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None


def load_chat_template(folder) -> Optional[ChatTemplate]:
    """The template of a checkpoint folder (``tokenizer_config.json``'s ``chat_template``, a string or
    a list of named templates where ``default`` wins, or ``chat_template.jinja``); None if it has none."""
    if folder is None or not os.path.isdir(folder):
        return None
    cfg = {}
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if not cfg.get("chat_template") and os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            cfg = {**cfg, "chat_template": f.read()}
    return chat_template_of(cfg)


def chat_template_of(cfg: dict) -> Optional[ChatTemplate]:
    """The template of a ``tokenizer_config.json``'s contents, with its special tokens; None without one."""
    template = cfg.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template:
        return None
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
    return ChatTemplate(template, special)
