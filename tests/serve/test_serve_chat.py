"""Chat messages to a prompt: the course's default template, a model's own template, Jinja's sandbox."""
import json

import jinja2.exceptions
import pytest

from nanoserve import COURSE_MODEL
from nanoserve.serve.chat import DEFAULT_TEMPLATE, ChatTemplate

MESSAGES = [{"role": "system", "content": "You answer with code."},
            {"role": "user", "content": "Add two numbers.\nIn Python."}]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_course_model_uses_the_documented_default():
    template = ChatTemplate.for_model(COURSE_MODEL)
    assert template.source == DEFAULT_TEMPLATE
    assert template.render(MESSAGES) == ("# system: You answer with code.\n"
                                         "# user: Add two numbers.\n# In Python.\n"
                                         "# assistant:")


def test_a_model_brings_its_own_template(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML,
                                                                 "eos_token": {"content": "<|im_end|>"}}))
    template = ChatTemplate.for_model(tmp_path)
    assert template.render(MESSAGES[1:]) == ("<|im_start|>user\nAdd two numbers.\nIn Python.<|im_end|>\n"
                                             "<|im_start|>assistant\n")
    assert template.special["eos_token"] == "<|im_end|>"


def test_templates_run_in_the_sandbox():
    hostile = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        hostile.render(MESSAGES)
