"""A chat template given by the user (`--chat-template`, `LLM(chat_template=...)`), as vLLM takes it: a
Jinja file, or the template itself inline; and messages whose content is OpenAI's list of parts, as
templates read them (one string)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

JINJA_CHARACTERS = "{}\n"


def load_chat_template(template: str | os.PathLike[str]) -> str:
    """The template text: a file that exists is read; else a string with Jinja's characters (`{`, `}` or a
    newline) is the template itself, its backslash escapes (`\\n`) decoded as vLLM does; anything else
    names a file that is not there: an error."""
    path = Path(template).expanduser()
    try:
        exists = path.is_file()
    except OSError:  # a name too long for a path: an inline template
        exists = False
    if exists:
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read the chat template file {template}: {exc}") from exc
    if isinstance(template, os.PathLike) or not any(c in template for c in JINJA_CHARACTERS):
        raise ValueError(f"chat template file not found: {template} (an inline template contains Jinja's "
                         "{{ }} or {% %})")
    # backslashreplace carries characters beyond Latin-1 through unicode_escape unchanged
    return template.encode("latin-1", "backslashreplace").decode("unicode_escape")


def string_contents(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with OpenAI's content parts (`[{"type": "text", "text": ...}]`) as one string, the text
    parts joined by newlines (vLLM's "string" content format, as the server does); ValueError for a part
    that is not text."""
    out = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            kinds = sorted({str(part.get("type")) if isinstance(part, dict) else type(part).__name__
                            for part in content if not _is_text(part)})
            if kinds:
                raise ValueError(f"only text content parts are supported, got {', '.join(kinds)}")
            message = message | {"content": "\n".join(part.get("text") or "" for part in content)}
        out.append(message)
    return out


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text"
