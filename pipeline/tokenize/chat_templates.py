"""`pack-data --chat-template`: the Jinja chat template that renders chat data instead of the
tokenizer's own (or for a tokenizer that has none, such as Llama-2's). A value is a template name
(`NAMED`), a Jinja file, or (from a config file) the template text itself.

The chosen template becomes the tokenizer's `chat_template` before anything is rendered, so it is
part of the tokenizer fingerprint the manifest records, and the manifest's `tokenizer` entry names
it (`chat_template`) and holds its text (`chat_template_text`): pack-train gives the model's
tokenizer the same template before comparing fingerprints, and its checkpoints carry it.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError, one_line

# The widely used formats, each as its authors publish it (generation prompt included); the
# tokenizer's own BOS token is written by the template where the format starts with one.
NAMED: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + messages[0]['content'] + "
        "'\n<</SYS>>\n\n' %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
        "(system if loop.first else '') + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == "
        "'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
}


def resolve_chat_template(value: str) -> str:
    """The Jinja text of `--chat-template VALUE`: a name of `NAMED`, a file, or template text
    (it holds `{%` or `{{`); anything else is a UserError listing the names.

    >>> resolve_chat_template("chatml").startswith("{% for message in messages %}")
    True
    """
    if value in NAMED:
        return NAMED[value]
    if "{%" in value or "{{" in value:
        return checked(value, "--chat-template (inline text)")
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--chat-template {value}: cannot read it ({exc})") from None
        if not text.strip():
            raise UserError(f"--chat-template {value}: the file is empty: give a file holding a Jinja chat template "
                            f"(or a name: {', '.join(NAMED)})")
        return checked(text, f"--chat-template {value}")
    raise UserError(f"--chat-template {value!r}: not a template name ({', '.join(NAMED)}) nor a Jinja file: "
                    "give one of those names or the path of a .jinja file")


def checked(text: str, name: str) -> str:
    """`text` when it compiles as a chat template; else a UserError naming `name` and the line."""
    import jinja2

    from pipeline.tokenize.template_sandbox import compile_template

    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{name}: not a valid Jinja template (line {exc.lineno}: {one_line(exc.message, 200)}): "
                        "fix it") from None
    return text


def template_label(value: str) -> str:
    """How the manifest names `--chat-template VALUE`: the name or path, or "inline" for template text."""
    return "inline" if value not in NAMED and ("{%" in value or "{{" in value) else value
