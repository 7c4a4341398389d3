"""Chat messages -> one prompt, with the model's own chat template, as Hugging Face renders it.

The template is `chat_template` in the model folder's tokenizer_config.json (a string, or a list of
named templates where "default" is used). It is Jinja, written by whoever published the model, so it
runs in Jinja's immutable sandbox: it can read what it is given and nothing else. The context is
Hugging Face's: `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
...) and `raise_exception`.
"""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from server.errors import InvalidInputError, UnsupportedError
from server.names import capped

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str]):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.special = special

    @classmethod
    def from_folder(cls, folder: Path) -> ChatTemplate | None:
        path = folder / "tokenizer_config.json"
        if not path.is_file():
            return None
        config = json.loads(path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        special = {k: _content(config[k]) for k in _SPECIAL if config.get(k) is not None}
        return cls(source, special)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """`tools`: OpenAI's tool objects, given to the template as Hugging Face's `tools` argument."""
        extra = {"tools": tools} if tools is not None else {}
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **extra, **self.special)
        except TemplateError as exc:
            raise InvalidInputError(f"the model's chat template refused these messages: {capped(str(exc), 300)}") from None


class Templates:
    """Each served version's chat template, read from its folder once per load (a reload gives a new
    runner, so the folder is read again). Both doors render chat prompts through here: /v1/chat/completions
    and gRPC Generate's `chat` prompt give a conversation the same prompt."""

    def __init__(self, root: Path):
        self.root = root
        self._cached: dict[tuple[str, int], tuple[object, ChatTemplate | None]] = {}

    def of(self, mv) -> ChatTemplate | None:
        cached = self._cached.get((mv.name, mv.version))
        if cached is None or cached[0] is not mv.runner:
            cached = (mv.runner, ChatTemplate.from_folder(self.root / mv.name / str(mv.version)))
            self._cached[(mv.name, mv.version)] = cached
        return cached[1]

    def prompt(self, mv, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The conversation as the prompt `mv` generates from; refusals are InvalidInputError."""
        template = self.of(mv)
        if template is None:
            raise InvalidInputError(f"model '{mv.name}' has no chat template (chat_template in tokenizer_config.json); "
                                    "use /v1/completions with a prompt")
        return template.render(checked_messages(messages), add_generation_prompt, tools)


def checked_messages(messages) -> list[dict]:
    """OpenAI chat messages with text content only (content parts of type 'text' are joined)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidInputError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidInputError(f"messages[{i}] must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise UnsupportedError(f"messages[{i}]: only text content parts are supported")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise InvalidInputError(f"messages[{i}]: 'content' must be a string or a list of text parts")
        out.append({**message, "content": content or ""})
    return out


def _content(token) -> str:
    return token.get("content", "") if isinstance(token, dict) else str(token)


def _raise(message: str):
    raise TemplateError(message)
