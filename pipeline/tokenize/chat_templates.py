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

# The widely used formats, named as Axolotl names them, each following the chat template its model's
# tokenizer_config.json ships (the model named beside it; written out here, not fetched, so a byte
# for byte comparison with the Hub's file is still to be made); the tokenizer's own BOS token is written by
# the template where the format starts with one. A template's markers must be tokens of the
# tokenizer (`pipeline.tokenize.render.check_has_template`): add them with --add-token /
# --special-token for a vocabulary that lacks them.
_QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
NAMED: dict[str, str] = {
    # ChatML (OpenAI's format, as Qwen and many fine-tunes ship it)
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    # meta-llama/Meta-Llama-3-8B-Instruct (its turns end with <|eot_id|>: pack-data adds no EOS after it)
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # meta-llama/Llama-2-7b-chat-hf
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set system = '<<SYS>>\n' + messages[0]['content'] + "
        "'\n<</SYS>>\n\n' %}{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
        "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + "
        "(system if loop.first else '') + message['content'] | trim + ' [/INST]' }}{% elif message['role'] == "
        "'assistant' %}{{ ' ' + message['content'] | trim + ' ' + eos_token }}{% endif %}{% endfor %}"
    ),
    # Qwen/Qwen2.5-7B-Instruct: ChatML with a default system message; tool calls and tool results
    "qwen_25": (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
        "'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\n" + _QWEN_SYSTEM + "<|im_end|>\n' }}{%- endif %}"
        "{%- for message in messages %}"
        "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
        "(message.role == 'assistant' and not message.tool_calls) %}"
        "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}"
        "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
        "{%- if message.content %}{{- '\n' + message.content }}{%- endif %}"
        "{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}"
        "{%- set tool_call = tool_call.function %}{%- endif %}"
        "{{- '\n<tool_call>\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
        "{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
        "{%- elif message.role == 'tool' %}"
        "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}"
        "{%- endif %}{{- '\n<tool_response>\n' }}{{- message.content }}{{- '\n</tool_response>' }}"
        "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\n' }}{%- endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
    ),
    # google/gemma-3-1b-it (text parts; the system message opens the first user turn)
    "gemma3": (
        "{{ bos_token }}"
        "{%- if messages[0]['role'] == 'system' -%}"
        "{%- if messages[0]['content'] is string -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
        "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
        "{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
        "{%- for message in loop_messages -%}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
        "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
        "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
        "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
        "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
        "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
        "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}"
        "{%- else -%}{{ raise_exception(\"Invalid content type\") }}{%- endif -%}"
        "{{ '<end_of_turn>\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
    ),
    # microsoft/Phi-3-mini-4k-instruct
    "phi_3": (
        "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'system') %}"
        "{{'<|system|>' + '\n' + message['content'] + '<|end|>' + '\n'}}{% elif (message['role'] == 'user') %}"
        "{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
        "{% elif message['role'] == 'assistant' %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}"
    ),
    # mistralai/Mistral-7B-Instruct-v0.1
    "mistral_v1": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token + ' ' }}"
        "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
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
