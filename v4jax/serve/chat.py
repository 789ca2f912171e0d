"""Chat messages to prompt text through the checkpoint's chat template, rendered as `transformers` renders it.

The template comes from the model directory: `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates: "default" is used). It is rendered in jinja2's
immutable sandbox with trim_blocks / lstrip_blocks and the loop-control extension, given `messages`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...), `raise_exception` and
`strftime_now`, as `apply_chat_template` does; the rendered text is tokenized without adding special tokens
(the template writes them). The embedded default model, which has no template, gets a play-script one."""
from __future__ import annotations

import datetime
import functools
import json
import os

# The Shakespeare model was trained on plays: a speaker's name in capitals, a colon, the speech.
DEFAULT_MODEL_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'developer'] %}{{ message['content'] }}\n\n"
    "{% else %}{{ message['role'] | upper }}:\n{{ message['content'] }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


class TemplateError(ValueError):
    """The template refused the conversation (its raise_exception), or failed to render it."""


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # an AddedToken as transformers saves it
        return v.get("content")
    return v if isinstance(v, str) else None


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = special_tokens

    @classmethod
    def from_model_dir(cls, path: str, *, default: bool = False) -> "ChatTemplate | None":
        """The directory's template; with default=True (the embedded model) the play-script one when the
        directory has none. None when there is none."""
        cfg = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                cfg = json.load(f)
        special = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                                  "mask_token") if (t := _token_text(cfg.get(k))) is not None}
        src = None
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                src = f.read()
        else:
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):
                named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
                tpl = named.get("default") or next(iter(named.values()), None)
            src = tpl if isinstance(tpl, str) else None
        if src is None and default:
            src = DEFAULT_MODEL_TEMPLATE
        return cls(src, special) if src is not None else None

    def reads(self, name: str) -> bool:
        """Whether the template reads the variable `name` (a template that never reads `tools` would drop them)."""
        from jinja2 import meta
        return name in meta.find_undeclared_variables(_environment().parse(self.source))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        import jinja2
        try:
            return _compiled(self.source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 **{**self.special_tokens, **kwargs})
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed: {e}") from None


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=1)
def _environment():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=8)
def _compiled(source: str):
    return _environment().from_string(source)
