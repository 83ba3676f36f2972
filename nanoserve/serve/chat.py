"""Chat messages to one prompt: the tokenizer's chat template when its config has one, else the course's.

A chat model was trained on conversations laid out one particular way, and its `tokenizer_config.json`
carries that layout as a Jinja template (`chat_template`); rendering it is all `/v1/chat/completions` adds
over `/v1/completions`. The course model was trained on Python source and has no template, so the server
uses a documented default that a code model continues naturally: each message as a comment line

    # system: You answer with code.
    # user: A function that adds two numbers.
    # assistant:

and the model writes the assistant's turn after the last line. Templates are rendered in Jinja's sandbox
(a template comes with a downloaded model: it must not reach Python's internals).
"""
from __future__ import annotations

import json
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment

DEFAULT_TEMPLATE = ("{% for m in messages %}# {{ m['role'] }}: {{ m['content'] | replace('\\n', '\\n# ') }}\n"
                    "{% endfor %}{% if add_generation_prompt %}# assistant:{% endif %}")


class ChatTemplate:
    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.source = template
        self.template = env.from_string(template)
        self.special = {"bos_token": bos_token, "eos_token": eos_token}

    @classmethod
    def for_model(cls, model_dir) -> "ChatTemplate":
        """The template of `model_dir/tokenizer_config.json`, or DEFAULT_TEMPLATE when it has none."""
        config_file = Path(model_dir) / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = config.get("chat_template") or DEFAULT_TEMPLATE
        if isinstance(template, list):   # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), DEFAULT_TEMPLATE)

        def token(name):
            t = config.get(name) or ""
            return t.get("content", "") if isinstance(t, dict) else t
        return cls(template, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
