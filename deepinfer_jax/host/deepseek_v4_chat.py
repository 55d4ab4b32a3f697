"""DeepSeek-V4's own message format (no jax), for the released checkpoints, which ship no Jinja
chat template: their `encoding/encoding_dsv4.py` writes the prompt in code. This renders the
conversations a chat API carries (system, user and assistant messages, an assistant's
`reasoning`) as that encoder does; tools, tasks and the developer / latest_reminder roles
are refused with a ChatTemplateError rather than rendered wrongly.

    <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{reply}<｜end▁of▁sentence｜>
    <｜User｜>{user}<｜Assistant｜></think>                    (chat mode)
    <｜User｜>{user}<｜Assistant｜><think>                     (thinking mode)

Each user message is followed by the assistant's opening: `</think>` in chat mode, and in
thinking mode `<think>` after the last user message (earlier turns keep `</think>`, and their
replies' reasoning is dropped, as the encoder's drop_thinking default does). A reply ends with
EOS; in thinking mode a reply after the last user message carries `{reasoning}</think>` before
its content.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deepinfer_jax.host.chat import ChatTemplate, ChatTemplateError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
_ROLES = ("system", "user", "assistant")
_UNSUPPORTED_FIELDS = ("tool_calls", "tools", "task", "content_blocks")


class DeepSeekV4Chat:
    """The V4 encoder's rendering of plain conversations; `thinking` picks the mode."""

    special_tokens = {"bos_token": BOS, "eos_token": EOS}

    @staticmethod
    def applies_to(token_to_id) -> bool:
        """Whether a tokenizer (its token_to_id) has V4's role tokens."""
        return all(token_to_id(t) is not None for t in (BOS, EOS, USER, ASSISTANT))

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = True,
               thinking: bool = False) -> str:
        if not isinstance(thinking, bool):
            raise TypeError(f"thinking must be true or false, got {thinking!r}")
        for i, m in enumerate(messages):
            if m.get("role") not in _ROLES:
                raise ChatTemplateError(f"messages[{i}]: role {m.get('role')!r} is not supported "
                                        f"by the DeepSeek-V4 format here (only {_ROLES})")
            if any(m.get(f) for f in _UNSUPPORTED_FIELDS):
                raise ChatTemplateError(f"messages[{i}]: tool calls and tasks are not supported "
                                        "by the DeepSeek-V4 format here")
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        out = [BOS]
        for i, m in enumerate(messages):
            content = m.get("content") or ""
            if m["role"] == "system":
                out.append(content)
            elif m["role"] == "user":
                out.append(USER + content)
                follows = messages[i + 1]["role"] if i + 1 < len(messages) else None
                if follows == "assistant" or (follows is None and add_generation_prompt):
                    opening = THINK if thinking and i == last_user else END_THINK
                    out.append(ASSISTANT + opening)
            else:                       # assistant
                reasoning = m.get("reasoning") or m.get("reasoning_content") or ""
                kept = reasoning + END_THINK if thinking and i > last_user else ""
                out.append(kept + content + EOS)
        return "".join(out)


def chat_format(directory, tokenizer):
    """The model's chat template (host/chat.py), else, for a tokenizer (host/tokenizer.py)
    with DeepSeek-V4's role tokens (the released checkpoints ship no template), V4's own
    message format; or None."""
    template = ChatTemplate.from_model_dir(directory)
    if template is None and tokenizer is not None and DeepSeekV4Chat.applies_to(
            tokenizer.token_to_id):
        return DeepSeekV4Chat()
    return template
