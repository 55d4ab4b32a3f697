"""host/chat.py: the Jinja subset of simple chat templates, rendered as transformers would."""

from __future__ import annotations

import json

import pytest

from deepinfer_jax.host.chat import ChatTemplate, ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def test_loop_fields_specials_and_generation_prompt():
    t = ChatTemplate("{{ bos_token }}{% for message in messages %}<{{ message['role'] }}>"
                     "{{ message.content }}{{ eos_token }}{% endfor %}"
                     "{% if add_generation_prompt %}<assistant>{% endif %}",
                     {"bos_token": "<s>", "eos_token": "</s>"})
    assert t.render(MESSAGES) == "<s><user>hi</s><assistant>hello</s><assistant>"
    assert t.render(MESSAGES, add_generation_prompt=False) == "<s><user>hi</s><assistant>hello</s>"


def test_whitespace_as_transformers_jinja_environment():
    # trim_blocks drops the newline after a block tag, lstrip_blocks the indent before one,
    # and the source's final newline goes
    source = "{% for message in messages %}\n  {{ message['content'] }}\n  {% endfor %}\n"
    assert ChatTemplate(source).render(MESSAGES) == "  hi\n  hello\n"


@pytest.mark.parametrize("source", [
    "{{ messages[0]['content'] }}",                                     # no loop
    "{% for message in messages %}{{ message['name'] }}{% endfor %}",   # unknown field
    "{% for message in messages %}{% if loop.first %}x{% endif %}{% endfor %}",
    "{% for message in messages %}{{ bos_token }}{% endfor %}",         # no such token given
    "{{ raise_exception('no') }}{% for message in messages %}{% endfor %}",
])
def test_outside_the_subset_is_refused(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source)


def test_from_model_dir(tmp_path):
    assert ChatTemplate.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"},
        "chat_template": [{"name": "default", "template": "{{ bos_token }}{% for message in messages %}"
                                                          "{{ message['content'] }}{% endfor %}"}]}))
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "<s>hihello"
    (tmp_path / "chat_template.jinja").write_text("{% for message in messages %}[{{ message['role'] }}]"
                                                   "{% endfor %}\n")
    assert ChatTemplate.from_model_dir(tmp_path).render(MESSAGES) == "[user][assistant]"
    with pytest.raises(ValueError, match="role"):
        ChatTemplate.from_model_dir(tmp_path).render([{"content": "x"}])
