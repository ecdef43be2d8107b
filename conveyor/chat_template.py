"""A chat template given by the user (`--chat-template`, `LLM(chat_template=...)`), as vLLM takes it: a
Jinja file, or the template itself inline."""

from __future__ import annotations

import os
from pathlib import Path

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
