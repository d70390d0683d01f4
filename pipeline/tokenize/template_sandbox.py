"""Chat templates rendered as the untrusted code they are: in Jinja's immutable sandbox, with a time
limit and a size limit, and with a pinned date.

A chat template comes from a file (a tokenizer folder, `--chat-template`), so it may loop for ever
(`range(100000)` twice nested), compute a number too large to hold (`10**(10**10)`) or build a
gigantic string (`'x' * 10**12`, `'x'.ljust(10**12)`). `render_template` renders it as
transformers' `apply_chat_template` does (the same sandbox class, options, extensions, filters and
globals, the tokenizer's special tokens as variables) with these bounds:
- every arithmetic operator, `~`, call and printed value is checked before it runs: an integer
  result past `MAX_INT_BITS` bits, a string or list result past `MAX_CHARS`, a number past
  `MAX_CHARS` given to a method or filter (a width, a count), or a list whose text past `MAX_CHARS`
  would be printed (`{{ [s] * 1000 }}`, `join`, `tojson`) stops the rendering;
- the rendering is stopped after `template_seconds()` (an exception raised in the rendering thread
  between two Python steps; the checks above keep each step short);
- its output is counted as it is made and stops at `MAX_CHARS`.
Each stops with one line naming the template. `strftime_now` (Llama 3.x templates print today's
date) formats `PINNED_DATE`, which the manifest records, so the same inputs give the same bytes.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import threading
import time
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.errors import UserError, one_line

MAX_CHARS = 1 << 26  # the longest string or list, and rendering, a template may make (64 Mi chars)
MAX_INT_BITS = 1 << 12  # the largest integer it may compute (about 10**1233)
PINNED_DATE = "2024-07-26"  # what `strftime_now` formats (Llama 3.1's own default date)
SECONDS_ENV = "PACKLM_TEMPLATE_SECONDS"  # the time limit of one rendering, in seconds (default 30)


def template_seconds() -> float:
    """The time limit of one rendering: `PACKLM_TEMPLATE_SECONDS`, default 30."""
    try:
        return max(float(os.environ.get(SECONDS_ENV, "30")), 0.01)
    except ValueError:
        raise UserError(f"{SECONDS_ENV}={os.environ[SECONDS_ENV]!r} is not a number of seconds: set it to one, such as 30") from None


class TemplateLimit(Exception):
    """A template exceeded a bound (time or size); its message says which."""


class _Timeout(BaseException):
    """Raised in the rendering thread by the watchdog (a BaseException: a template's own error
    handling never catches it)."""


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, bytes)) else 0


def _check_result_size(op: str, left: Any, right: Any) -> None:
    """Refuse `left op right` before it runs when its result would exceed the bounds."""
    if isinstance(left, bool) or isinstance(right, bool):
        return
    ints = isinstance(left, int) and isinstance(right, int)
    if op == "**" and ints and right > 0 and abs(left) > 1:
        if right * (abs(left).bit_length()) > MAX_INT_BITS:
            raise TemplateLimit(f"a power (** {one_line(right, 40)}) is larger than {MAX_INT_BITS} bits")
    elif op == "*" and ints:
        if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product is larger than {MAX_INT_BITS} bits")
    elif op == "*":
        count = right if isinstance(right, int) else left if isinstance(left, int) else 0
        if count > 0 and max(_size(left), _size(right)) * count > MAX_CHARS:
            raise TemplateLimit(f"a repeated string or list is longer than {MAX_CHARS} items")
    elif op == "+" and _size(left) + _size(right) > MAX_CHARS:
        raise TemplateLimit(f"a joined string or list is longer than {MAX_CHARS} items")


def _check_arguments(args: tuple, kwargs: dict) -> None:
    """A number past MAX_CHARS given to a method or filter (a width, a count, an index) would make
    something past it (`'x'.ljust(10**12)`, `center`, `indent`): refused."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
            raise TemplateLimit(f"a number of {value.bit_length()} bits is passed to a method or filter (more than {MAX_CHARS})")


PRINTS_ITS_VALUES = {
    "tojson",
    "join",
    "string",
    "pprint",
    "list",
    "urlencode",
    "xmlattr",
    "format",
    "map",
    "batch",
    "slice",
    "sum",
}  # filters whose result is as large as what their values hold


def _check_contents(values: tuple) -> None:
    """The text `values` hold (strings inside lists and mappings, each time they are referred to)
    past MAX_CHARS: refused, before a filter or method prints it all (`[s] * 1000 | join`)."""
    total, stack, steps = 0, list(values), 0
    while stack:
        value = stack.pop()
        steps += 1
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
        if total > MAX_CHARS or steps > MAX_CHARS:
            raise TemplateLimit(f"a filter or method would print more than {MAX_CHARS} characters")


def _finalize(value: Any) -> Any:
    """Each value a template prints (`{{ value }}`), checked before it becomes text."""
    if isinstance(value, (list, tuple, dict)):
        _check_contents((value,))
    return value


def _bounded_filter(name: str, function: Any) -> Any:
    @wraps(function)  # keeps Jinja's pass_context / pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[1:], kwargs)
        if name in PRINTS_ITS_VALUES:
            _check_contents(tuple(a for a in args if isinstance(a, (str, list, tuple, dict))))
        if function.__name__ == "do_format":  # printf-style: its widths
            _check_printf_widths(next((a for a in args if isinstance(a, str)), ""))
        result = function(*args, **kwargs)
        if _size(result) > MAX_CHARS:
            raise TemplateLimit(f"a filter made a string or list longer than {MAX_CHARS} items")
        return result

    return bounded


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator, its `~` (string concatenation) checked like `+`."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox with every operator and call bounded (see the module)."""

    intercepted_binops = frozenset(["+", "*", "**", "%"])
    code_generator_class = _CodeGenerator

    @staticmethod
    def checked_concat(parts: tuple) -> str:
        texts = [str(part) for part in parts]
        if sum(map(len, texts)) > MAX_CHARS:
            raise TemplateLimit(f"a joined string is longer than {MAX_CHARS} characters")
        return "".join(texts)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_result_size(operator, left, right)
        if operator == "%" and isinstance(left, str):  # printf: its widths, and a '*' width from the values
            _check_printf_widths(left)
            _check_arguments(right if isinstance(right, tuple) else (right,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - Jinja's signature
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") == "replace":
            _check_replace(owner, args)
        if isinstance(owner, str) and getattr(__obj, "__name__", "") == "join":
            _check_contents(args)
        result = super().call(__context, __obj, *args, **kwargs)
        if _size(result) > MAX_CHARS:
            raise TemplateLimit(f"a call made a string or list longer than {MAX_CHARS} items")
        return result

    def wrap_str_format(self, value: Any) -> Any:  # str.format / format_map, sandboxed: their widths first
        if getattr(value, "__name__", "") in ("format", "format_map") and isinstance(getattr(value, "__self__", None), str):
            _check_format_widths(value.__self__)
        return super().wrap_str_format(value)


def _check_printf_widths(text: str) -> None:
    """A printf width or precision past MAX_CHARS (`'%0999999999d' % 1`) is refused."""
    for match in re.finditer(r"%[-+ #0]*(\d+)?(?:\.(\d+))?", text):
        for number in match.groups():
            if number and int(number) > MAX_CHARS:
                raise TemplateLimit(f"a printf width of {one_line(number, 40)} characters")


def _check_format_widths(text: str) -> None:
    """A str.format width past MAX_CHARS (`'{:>999999999}'.format(1)`) is refused."""
    for field in re.finditer(r"\{[^{}]*\}", text):
        if any(int(number) > MAX_CHARS for number in re.findall(r"\d+", field.group())):
            raise TemplateLimit("a format width past the size limit")


def _check_replace(text: str, args: tuple) -> None:
    if len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grows = (len(text) + 1) * len(args[1]) if not args[0] else (text.count(args[0]) * len(args[1]))
        if grows + len(text) > MAX_CHARS:
            raise TemplateLimit(f"a replace would make a string longer than {MAX_CHARS} characters")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant mask marks): renders its body;
    `render_template(..., spans=True)` records where each such block lands in the output."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_support"), [], [], body).set_lineno(lineno)

    def _support(self, caller: Any) -> str:
        text = caller()
        tracker = _tracking.blocks
        if tracker is not None:
            start = sum(map(len, tracker[0]))
            tracker[1].append((start, start + len(text)))
        return text


class _Tracking(threading.local):
    blocks: tuple[list[str], list[tuple[int, int]]] | None = None


_tracking = _Tracking()


def _raise_exception(message: Any) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - transformers' name for the argument
    return datetime.fromisoformat(PINNED_DATE).strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """transformers' namespace: no underscore-prefixed attribute may be stored."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=16)
def compile_template(text: str) -> jinja2.Template:
    """The template compiled in a `BoundedEnvironment` set up as transformers sets its own."""
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols], finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(), namespace=_Namespace)
    return env.from_string(text)


class _Watchdog:
    """One daemon thread that raises `_Timeout` in a rendering thread past its deadline."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.deadlines: dict[int, float] = {}
        self.fired: set[int] = set()
        self.thread: threading.Thread | None = None
        # the watch's pause between looks: an Event's wait, not time.sleep, so that code which
        # patches or stubs time.sleep (tests do) cannot turn this loop into a busy one
        self.pause = threading.Event()

    def start(self, seconds: float) -> None:
        """Watch the current thread for `seconds` (anew: a watch that an earlier stop left is replaced)."""
        with self.lock:
            self.fired.discard(threading.get_ident())
            self.deadlines[threading.get_ident()] = time.monotonic() + seconds
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._watch, name="packlm-template-watchdog", daemon=True)
                self.thread.start()

    def stop(self) -> None:
        """End the current thread's watch; an exception sent but not yet raised is taken back."""
        ident = threading.get_ident()
        with self.lock:
            self.deadlines.pop(ident, None)
            if ident in self.fired:
                self.fired.discard(ident)
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), None)

    def _watch(self) -> None:
        while True:
            self.pause.wait(0.05)
            now = time.monotonic()
            with self.lock:
                for ident, deadline in list(self.deadlines.items()):
                    if now > deadline and ident not in self.fired:
                        self.fired.add(ident)
                        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(_Timeout))


_WATCHDOG = _Watchdog()


def render_template(text: str, name: str, spans: bool = False, **variables: Any) -> str | tuple[str, list[tuple[int, int]]]:
    """Render chat template `text` (named `name` in errors) with `variables` within the bounds; with
    `spans`, also the (start, end) of each `{% generation %}` block in the output. A bound exceeded
    is a UserError naming the template; a template error is raised as it is."""
    template = compile_template(text)
    seconds = template_seconds()
    blocks: list[str] = []
    generated: list[tuple[int, int]] = []
    size = 0
    try:
        _WATCHDOG.start(seconds)
        try:
            _tracking.blocks = (blocks, generated) if spans else None
            for block in template.generate(**variables):
                size += len(block)
                if size > MAX_CHARS:
                    raise TemplateLimit(f"its output is longer than {MAX_CHARS} characters")
                blocks.append(block)
        finally:
            _WATCHDOG.stop()
            _tracking.blocks = None
    except _Timeout:
        raise UserError(
            f"the chat template {name} did not finish rendering one conversation within {seconds:g} s "
            f"(an endless or huge loop?): fix the template, or raise {SECONDS_ENV}"
        ) from None
    except TemplateLimit as exc:
        raise UserError(f"the chat template {name} exceeds a size limit: {exc}: fix the template") from None
    except (MemoryError, RecursionError, OverflowError) as exc:
        raise UserError(f"the chat template {name} exceeds a limit ({type(exc).__name__}): fix the template") from None
    rendered = "".join(blocks)
    return (rendered, generated) if spans else rendered


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers fills the first two from any


def apply_chat_template(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = False,
    spans: bool = False,
    extra: dict[str, Any] | None = None,
) -> Any:
    """`tokenizer.apply_chat_template(messages, tokenize=False, ...)` as transformers renders it (its
    variables: the tokenizer's special tokens, `messages` with the reasoning aliases it adds, `tools`
    and `documents` None), within the bounds of `render_template`; with `spans`, the generation
    blocks' (start, end) too; `extra`: more variables (the template's own keyword arguments)."""
    aliased = []
    for message in messages:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        aliased.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    variables = {
        **getattr(tokenizer, "special_tokens_map", {}),
        "messages": aliased,
        "tools": None,
        "documents": None,
        "add_generation_prompt": add_generation_prompt,
        **(extra or {}),
    }
    return render_template(tokenizer.chat_template, template_name(tokenizer), spans=spans, **variables)


def template_name(tokenizer: Any) -> str:
    """How errors name the tokenizer's chat template: `--chat-template`'s name or path, or the tokenizer's."""
    label = getattr(tokenizer, "_packlm_template_label", None)
    return f"--chat-template {label}" if label else f"of tokenizer {getattr(tokenizer, 'name_or_path', '')!r}"
