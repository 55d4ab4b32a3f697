"""DeepSeek-V4's message format (host/deepseek_v4_chat.py) renders conversations as the
released encoder (encoding/encoding_dsv4.py) does; the expected strings follow its README and
its rules (chat vs thinking mode, earlier turns' reasoning dropped)."""

from __future__ import annotations

import pytest

from deepinfer_jax.host.chat import ChatTemplateError
from deepinfer_jax.host.deepseek_v4_chat import DeepSeekV4Chat

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
ASK = {"role": "user", "content": "What is 2+2?"}


def test_one_question_in_thinking_and_chat_mode():
    chat = DeepSeekV4Chat()
    head = "<｜begin▁of▁sentence｜>You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>"
    assert chat.render([SYSTEM, ASK], thinking=True) == head + "<think>"
    assert chat.render([SYSTEM, ASK]) == head + "</think>"
    assert chat.render([SYSTEM, ASK], add_generation_prompt=False) == head[:-len("<｜Assistant｜>")]


def test_earlier_turns_close_their_thinking_and_drop_their_reasoning():
    history = [ASK, {"role": "assistant", "content": "4", "reasoning": "Simple arithmetic."},
               {"role": "user", "content": "And 3+3?"}]
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    first = f"{bos}<｜User｜>What is 2+2?<｜Assistant｜></think>4{eos}<｜User｜>And 3+3?<｜Assistant｜>"
    assert DeepSeekV4Chat().render(history, thinking=True) == first + "<think>"
    assert DeepSeekV4Chat().render(history) == first + "</think>"
    # a reply after the last question keeps its reasoning (thinking mode)
    prefill = [ASK, {"role": "assistant", "content": "4", "reasoning": "Easy."}]
    assert DeepSeekV4Chat().render(prefill, thinking=True) == (
        f"{bos}<｜User｜>What is 2+2?<｜Assistant｜><think>Easy.</think>4{eos}")


def test_what_it_does_not_render_is_refused():
    with pytest.raises(ChatTemplateError, match="role 'tool'"):
        DeepSeekV4Chat().render([ASK, {"role": "tool", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="tool calls"):
        DeepSeekV4Chat().render([{**ASK, "tools": [{"type": "function"}]}])
    with pytest.raises(TypeError, match="thinking"):
        DeepSeekV4Chat().render([ASK], thinking="yes")
