"""Chat templates (no jax): a conversation as the model's prompt text, for `LLM.chat`.

The template is the model directory's, where transformers looks: `chat_template.jinja`, or the
`chat_template` string of `tokenizer_config.json`. jinja2 is not a dependency, so this is a
small formatter for the subset of Jinja that simple templates use, and renders it exactly as
Jinja (and so transformers' `apply_chat_template`) would:

    [head] {% for message in messages %} body {% endfor %}
           [{% if add_generation_prompt %} generation prompt {% endif %}]

where head, body and generation prompt are text with `{{ bos_token }}` / `{{ eos_token }}`
(from tokenizer_config.json), and the body also `{{ message['role'] }}` and
`{{ message['content'] }}` (or `message.role` / `message.content`). Any other tag is refused
with a `ChatTemplateError` that names it. The rendered text carries its own special tokens, so
it is tokenized without adding any (vLLM does the same).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path


class ChatTemplateError(ValueError):
    pass


_SHAPE = re.compile(
    r"(?P<head>.*?)\{%\s*for message in messages\s*%\}(?P<body>.*?)\{%\s*endfor\s*%\}"
    r"(?:\{%\s*if add_generation_prompt\s*%\}(?P<gen>.*?)\{%\s*endif\s*%\})?(?P<tail>.*)", re.S)
_EXPR = re.compile(r"\{\{\s*(.*?)\s*\}\}", re.S)
_MESSAGE_FIELD = re.compile(r"""message(?:\[\s*['"](\w+)['"]\s*\]|\.(\w+))""")


class ChatTemplate:
    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})   # {"bos_token": "<s>", ...}
        match = _SHAPE.fullmatch(_as_transformers_loads(source))
        if match is None:
            raise ChatTemplateError("the chat template is not one loop over messages; this "
                                    "formatter (host/chat.py) renders only that subset of Jinja")
        self._head, self._body = match["head"], match["body"]
        self._gen, tail = match["gen"] or "", match["tail"]
        for part, fields in ((self._head, ()), (self._body, ("role", "content")),
                             (self._gen, ()), (tail, ())):
            self._check(part, fields)
        self._tail = tail

    def _check(self, part: str, fields: tuple[str, ...]) -> None:
        if "{%" in part or "{#" in part:
            raise ChatTemplateError(f"unsupported tag in the chat template: {part!r:.80}")
        for expr in _EXPR.findall(part):
            field = _MESSAGE_FIELD.fullmatch(expr)
            known = (field is not None and (field[1] or field[2]) in fields) or expr in self.special_tokens
            if not known:
                raise ChatTemplateError(f"unsupported expression in the chat template: "
                                        f"{{{{ {expr} }}}}")

    def _fill(self, part: str, message: Mapping[str, str] | None = None) -> str:
        def value(m: re.Match) -> str:
            field = _MESSAGE_FIELD.fullmatch(m[1])
            if field is not None:
                return str(message[field[1] or field[2]])
            return self.special_tokens[m[1]]
        return _EXPR.sub(value, part)

    def render(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True
               ) -> str:
        for m in messages:
            if not isinstance(m, Mapping) or not {"role", "content"} <= set(m):
                raise ValueError(f"each message must be a dict with 'role' and 'content', got {m!r:.80}")
        return (self._fill(self._head) + "".join(self._fill(self._body, m) for m in messages)
                + (self._fill(self._gen) if add_generation_prompt else "") + self._fill(self._tail))

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> "ChatTemplate | None":
        """The directory's template (chat_template.jinja, else tokenizer_config.json's), or
        None when it has none."""
        directory = Path(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        specials = {}
        for name in ("bos_token", "eos_token"):
            token = config.get(name)
            token = token.get("content") if isinstance(token, dict) else token
            if isinstance(token, str):
                specials[name] = token
        jinja = directory / "chat_template.jinja"
        source = jinja.read_text() if jinja.exists() else config.get("chat_template")
        if isinstance(source, list):      # transformers' named templates
            source = {t.get("name"): t.get("template") for t in source}.get("default")
        return None if source is None else cls(source, specials)


def _as_transformers_loads(source: str) -> str:
    """The whitespace Jinja drops in transformers' environment (trim_blocks, lstrip_blocks, no
    kept trailing newline): a newline after a block tag, blanks before one at a line start,
    and the source's final newline."""
    source = source[:-1] if source.endswith("\n") else source
    source = re.sub(r"(^|\n)[ \t]+\{%", r"\1{%", source)
    return re.sub(r"%\}\n", "%}", source)
