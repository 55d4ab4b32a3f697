"""Which chat format a model gets: its own template where it ships one (the tiny model), else
DeepSeek-V4's message format for a tokenizer with V4's role tokens, else none."""

from __future__ import annotations

from tokenizers import Tokenizer, models

from deepinfer_jax.api.llm import DEFAULT_MODEL, chat_format
from deepinfer_jax.host.chat import ChatTemplate
from deepinfer_jax.host.deepseek_v4_chat import ASSISTANT, BOS, EOS, USER, DeepSeekV4Chat
from deepinfer_jax.host.tokenizer import TextTokenizer


def _tokenizer_dir(tmp_path, specials: list[str]):
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1}, unk_token="[UNK]"))
    tok.add_special_tokens(specials)
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_the_shipped_model_keeps_its_template():
    found = chat_format(DEFAULT_MODEL, TextTokenizer.from_model_dir(DEFAULT_MODEL))
    assert isinstance(found, ChatTemplate)


def test_a_v4_tokenizer_without_a_template_gets_v4_s_format(tmp_path):
    path = _tokenizer_dir(tmp_path, [BOS, EOS, USER, ASSISTANT])
    found = chat_format(path, TextTokenizer.from_model_dir(path))
    assert isinstance(found, DeepSeekV4Chat)
    assert found.render([{"role": "user", "content": "hello"}]) == f"{BOS}{USER}hello{ASSISTANT}</think>"


def test_another_tokenizer_without_a_template_gets_none(tmp_path):
    path = _tokenizer_dir(tmp_path, ["<s>", "</s>"])
    assert chat_format(path, TextTokenizer.from_model_dir(path)) is None
