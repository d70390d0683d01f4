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
from typing import Any

from pipeline.errors import UserError, one_line
from pipeline.foreign.data import DROP_FIRST_SYSTEM
from pipeline.foreign.keys import TRL_TRAINING
from pipeline.tokenize.templates_axolotl import AXOLOTL
from pipeline.tokenize.templates_axolotl_tools import AXOLOTL as AXOLOTL_TOOLS

# The widely used formats, named as Axolotl names them: Axolotl's own template text (its files,
# copied unchanged into `templates_axolotl` and `templates_axolotl_tools`), and Llama-2's, which
# Axolotl does not ship (written out from meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json).
# A template's markers must be tokens of the tokenizer (`pipeline.tokenize.render.check_has_template`):
# add them with --add-token / --special-token for a vocabulary that lacks them.
_LLAMA2 = (  # meta-llama/Llama-2-7b-chat-hf
    "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + messages[0]['content'] + "
    "'\n<</SYS>>\n\n' %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
    "(system if loop.first else '') + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == "
    "'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
)
_ORDER = (
    "chatml",
    "llama3",
    "llama2",
    "qwen_25",
    "qwen3",
    "gemma",
    "gemma3",
    "phi_3",
    "mistral_v1",
    "mistral_v3_tekken",
    "mistral_v7_tekken",
)
OWN = "the tokenizer's own"  # how a label names the tokenizer's template
NAMED: dict[str, str] = {name: {**AXOLOTL, **AXOLOTL_TOOLS, "llama2": _LLAMA2}[name] for name in _ORDER}


def resolve_chat_template(value: str) -> str:
    """The Jinja text of `--chat-template VALUE`: a name of `NAMED`, a file, or template text
    (it holds `{%` or `{{`); anything else is a UserError listing the names.

    >>> "<|im_start|>" in resolve_chat_template("chatml")
    True
    """
    if value in NAMED:
        return NAMED[value]
    if value.startswith(TRL_TRAINING):  # a TRL file's assistant_only_loss, before its template (if any)
        rest = value[len(TRL_TRAINING) :]
        return TRL_TRAINING + (resolve_chat_template(rest) if rest else "")
    if value.startswith(DROP_FIRST_SYSTEM):  # an Axolotl file's drop_system_message, before its template
        return DROP_FIRST_SYSTEM + resolve_chat_template(value[len(DROP_FIRST_SYSTEM) :])
    if "{%" in value or "{{" in value:
        return checked(value, "--chat-template (inline text)")
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"--chat-template {value}: cannot read it ({exc})") from None
        if not text.strip():
            raise UserError(
                f"--chat-template {value}: the file is empty: give a file holding a Jinja chat template (or a name: {', '.join(NAMED)})"
            )
        return checked(text, f"--chat-template {value}")
    raise UserError(
        f"--chat-template {value!r}: not a template name ({', '.join(NAMED)}) nor a Jinja file: "
        "give one of those names or the path of a .jinja file"
    )


def default_variant(template: Any, name: str) -> Any:
    """A tokenizer's chat template as transformers' apply_chat_template uses it without a template
    name: of named variants (a dict, e.g. {"default": ..., "tool_use": ...}) the "default" one; a
    dict without one is refused in one line naming `name` and its variants."""
    if not isinstance(template, dict):
        return template
    if "default" not in template:
        raise UserError(
            f"tokenizer {name!r}: its chat template has named variants ({', '.join(map(str, template))}) "
            "and none is 'default': pass --chat-template with the one to use (a name or a .jinja file)"
        )
    return template["default"]


def chosen_template(value: str | dict, own: Any) -> tuple[Any, str]:
    """The chat template `--chat-template VALUE` gives a tokenizer whose own template is `own`, and
    how the manifest names it. After `TRL_TRAINING` (a TRL file's assistant_only_loss: true), the
    template that follows it, or `own` when none does, is replaced by TRL's training version where TRL
    ships one (`templates_trl.training_version`, as TRL's SFTTrainer swaps it), else kept as it is."""
    if isinstance(value, dict):  # a tokenizer's named variants, handed on as they are (to Ray's tasks)
        return value, OWN
    if not value.startswith(TRL_TRAINING):
        return resolve_chat_template(value), template_label(value)
    from pipeline.tokenize.templates_trl import training_version

    rest = value[len(TRL_TRAINING) :]
    template = resolve_chat_template(rest) if rest else own
    found = training_version(template)
    label = template_label(rest) if rest else OWN
    if found is None:
        return template, f"{label} (not one TRL 1.16 swaps under assistant_only_loss)"
    return found[1], f"TRL's {found[0]} training template (assistant_only_loss: {label} is TRL's {found[0]})"


def checked(text: str, name: str) -> str:
    """`text` when it compiles as a chat template; else a UserError naming `name` and the line."""
    import jinja2

    from pipeline.tokenize.template_sandbox import compile_template

    try:
        compile_template(text)
    except jinja2.TemplateSyntaxError as exc:
        raise UserError(f"{name}: not a valid Jinja template (line {exc.lineno}: {one_line(exc.message, 200)}): fix it") from None
    return text


def template_label(value: str) -> str:
    """How the manifest names `--chat-template VALUE`: the name or path, or "inline" for template text."""
    if value.startswith(DROP_FIRST_SYSTEM):
        return f"{template_label(value[len(DROP_FIRST_SYSTEM) :])} (its first system message dropped)"
    if value.startswith(TRL_TRAINING):
        rest = value[len(TRL_TRAINING) :]
        return f"{template_label(rest) if rest else OWN} (TRL's training version where TRL ships one)"
    return "inline" if value not in NAMED and ("{%" in value or "{{" in value) else value
