"""Chat templates: where ``data.format = "chat"`` finds its template, how it renders a
conversation (as Hugging Face ``apply_chat_template`` does), and which characters of the result
belong to the assistant turns.

**Where the template comes from** (:func:`load_chat_template`): ``data.chat_template`` when set
(a Jinja string, or the path of a file holding one: a ``.jinja`` / text file, or a JSON file with
a ``chat_template`` field); otherwise the files beside ``data.tokenizer``'s ``tokenizer.json``:
``chat_template.jinja`` first, then ``tokenizer_config.json``'s ``chat_template`` (a string, or a
list of ``{name, template}`` of which ``default`` is taken). The special tokens the template may
name (``bos_token``, ``eos_token``, ...) are ``tokenizer_config.json``'s ``*_token`` entries.

**Rendering** (:func:`render`) uses a sandboxed Jinja environment
(``jinja2.sandbox.ImmutableSandboxedEnvironment``: templates come from files, so they may not
reach Python internals or change the messages), with the settings and helpers of Hugging Face's:
``trim_blocks``, ``lstrip_blocks``, the loop controls extension, ``raise_exception(message)``,
``strftime_now(format)``, a ``tojson`` filter that does not escape HTML (``json.dumps`` with
``ensure_ascii=False``, ``indent``, ``separators``, ``sort_keys``), the ``{% generation %}`` block,
and the variables ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the
special tokens.

**The assistant spans** (:func:`assistant_spans`), the characters whose tokens are trained on:

- A template with ``{% generation %}...{% endgeneration %}`` blocks marks them itself (what
  Hugging Face's ``return_assistant_tokens_mask`` reads): it is rendered once with each block's
  output wrapped in two Unicode noncharacters (U+FDD0, U+FDD1), whose positions, once removed,
  are the spans.
- Any other template is rendered message by message: for an assistant message ``i`` the
  conversation before it with the generation prompt (``messages[:i]``,
  ``add_generation_prompt=True``) must be a prefix of the conversation through it
  (``messages[:i + 1]``), and both of the whole one; the span is what lies between the two: the
  assistant's content and whatever the template closes its turn with (an end-of-turn token, a
  newline). A template that renders earlier turns differently once later ones follow (one that
  drops earlier reasoning, say) fails this check, and the row is refused with a message naming
  the message; such a template needs ``{% generation %}`` markers (``data.chat_template``).
  Hugging Face's own mask would silently be all zeros for such a template: it only reads markers.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import hashlib
import json
from datetime import datetime
from pathlib import Path

from meshtrain.config import ConfigError

OPEN, CLOSE = "\ufdd0", "\ufdd1"
"""What a ``{% generation %}`` block's output is wrapped in while spans are tracked (Unicode
noncharacters: never part of text exchanged between programs)."""
_TRACKING: contextvars.ContextVar[bool] = contextvars.ContextVar("generation_tracking",
                                                                 default=False)


class TemplateRenderError(ValueError):
    """A conversation the template cannot render, or whose assistant spans cannot be found."""


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template's Jinja source, where it came from, and the special tokens it sees."""

    text: str
    """The Jinja source."""
    origin: str
    """Where it was read from (for messages): ``data.chat_template`` or a file."""
    special_tokens: tuple[tuple[str, str], ...] = ()
    """``(name, token)`` pairs such as ``("bos_token", "<s>")``, passed to the template."""

    @property
    def sha256(self) -> str:
        """Digest of the source and special tokens (a cache key of rendered data)."""
        return hashlib.sha256(json.dumps([self.text, list(self.special_tokens)]).encode()
                              ).hexdigest()

    @property
    def has_generation_blocks(self) -> bool:
        """Whether the template marks assistant output with ``{% generation %}`` blocks."""
        return "generation" in _block_names(self.text)


@functools.lru_cache(maxsize=8)
def _block_names(text: str) -> frozenset[str]:
    """Names of the Jinja statements in ``text`` (``for``, ``if``, ``generation``, ...)."""
    _jinja()
    from jinja2 import Environment
    from jinja2.lexer import TOKEN_BLOCK_BEGIN, TOKEN_NAME

    names, after_begin = set(), False
    try:
        for _, kind, value in Environment().lex(text):
            if kind == "whitespace":
                continue
            if after_begin and kind == TOKEN_NAME:
                names.add(value)
            after_begin = kind == TOKEN_BLOCK_BEGIN
    except Exception:  # a syntax error: compile_template reports it
        pass
    return frozenset(names)


def _jinja():
    try:
        import jinja2  # noqa: F401
    except ImportError:
        raise ConfigError('data.format = "chat" needs the "jinja2" package '
                          '(pip install "meshtrain[data]").') from None


@functools.lru_cache(maxsize=8)
def compile_template(text: str, origin: str = "data.chat_template"):
    """``text`` compiled in the sandboxed environment (see the module docstring); cached.
    Raises :class:`ConfigError` naming ``origin`` for a template that does not parse."""
    _jinja()
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: its output, wrapped in :data:`OPEN` and
        :data:`CLOSE` while spans are tracked."""

        tags = {"generation"}

        def parse(self, parser):
            line = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_wrap"), [], [], body).set_lineno(line)

        def _wrap(self, caller):
            output = caller()
            return f"{OPEN}{output}{CLOSE}" if _TRACKING.get() else output

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(form):
        return datetime.now().strftime(form)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, "jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        return environment.from_string(text)
    except jinja2.TemplateSyntaxError as error:
        raise ConfigError(f"{origin}: the chat template does not parse: {error.message} (line "
                          f"{error.lineno} of the template).") from None


def render(template: ChatTemplate, messages: list, add_generation_prompt: bool = False,
           tools=None, track: bool = False) -> str:
    """The text of ``messages`` rendered with ``template``; with ``track``, each
    ``{% generation %}`` block's output wrapped in :data:`OPEN` / :data:`CLOSE`. Raises
    :class:`TemplateRenderError` when the template refuses the conversation
    (``raise_exception``), breaks the sandbox or fails otherwise."""
    import jinja2

    compiled = compile_template(template.text, template.origin)
    token = _TRACKING.set(track)
    try:
        return compiled.render(messages=messages, tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt,
                               **dict(template.special_tokens))
    except jinja2.exceptions.SecurityError as error:
        raise TemplateRenderError(f"the chat template tried something the sandbox refuses "
                                  f"({error}).") from None
    except jinja2.TemplateError as error:
        raise TemplateRenderError(f"the chat template refused it: {error}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as error:
        raise TemplateRenderError(f"the chat template failed on it "
                                  f"({type(error).__name__}: {error}).") from None
    finally:
        _TRACKING.reset(token)


def _marked_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """``marked`` without :data:`OPEN` / :data:`CLOSE`, and the (non-empty) spans they
    enclosed, as character offsets into the text without them."""
    parts, spans, start, length, position = [], [], None, 0, 0
    while True:
        found = [i for i in (marked.find(OPEN, position), marked.find(CLOSE, position)) if i >= 0]
        if not found:
            parts.append(marked[position:])
            break
        mark = min(found)
        parts.append(marked[position:mark])
        length += mark - position
        if marked[mark] == OPEN:
            if start is not None:
                raise TemplateRenderError("the template nests {% generation %} blocks.")
            start = length
        else:
            if start is None:
                raise TemplateRenderError("the template's {% generation %} blocks are not "
                                          "balanced.")
            if length > start:
                spans.append((start, length))
            start = None
        position = mark + 1
    if start is not None:
        raise TemplateRenderError("the template's {% generation %} blocks are not balanced.")
    return "".join(parts), spans


def assistant_spans(template: ChatTemplate, messages: list, tools=None,
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans ``[start, end)`` of its assistant
    turns (see the module docstring: the template's ``{% generation %}`` blocks when it has
    them, else each assistant message rendered incrementally). Raises
    :class:`TemplateRenderError`."""
    if any(OPEN in str(m.get("content")) or CLOSE in str(m.get("content")) for m in messages):
        raise TemplateRenderError("a message holds U+FDD0 or U+FDD1, which meshtrain reserves "
                                  "for marking assistant spans.")
    if template.has_generation_blocks:
        return _marked_spans(render(template, messages, tools=tools, track=True))
    whole = render(template, messages, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = render(template, messages[:i], add_generation_prompt=True, tools=tools)
        through = render(template, messages[:i + 1], tools=tools)
        if not (through.startswith(before) and whole.startswith(through)):
            which = "the conversation before it (with the generation prompt)" \
                if not through.startswith(before) else "the conversation through it"
            raise TemplateRenderError(
                f"message {i} (assistant): {which} does not render as the start of the longer "
                "conversation, so its tokens cannot be told apart. The template renders earlier "
                "turns differently once later ones follow; give data.chat_template a template "
                "that marks assistant output with {% generation %} ... {% endgeneration %}.")
        if len(through) > len(before):
            spans.append((len(before), len(through)))
    return whole, spans


def _special_tokens(config: dict) -> tuple[tuple[str, str], ...]:
    """The ``*_token`` entries of a ``tokenizer_config.json`` (strings or ``{"content"}``)."""
    pairs = []
    for name, value in sorted(config.items()):
        if isinstance(value, dict):
            value = value.get("content")
        if name.endswith("_token") and isinstance(value, str):
            pairs.append((name, value))
    return tuple(pairs)


def _read_json(path: Path, setting: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise ConfigError(f"{setting}: {path} is not readable JSON ({error}).") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{setting}: {path} does not hold a JSON object.")
    return data


def _template_of(config: dict, path: Path, setting: str) -> str | None:
    """The ``chat_template`` of a config dict: a string, or the ``default`` of a list of named
    templates; None when it has none."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value
                 if isinstance(item, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ConfigError(f"{setting}: {path} holds named chat templates "
                          f"({', '.join(map(str, named))}) but none called \"default\"; set "
                          "data.chat_template to the one to use (its text, or a file).")
    raise ConfigError(f"{setting}: {path}'s chat_template is {type(value).__name__}, not a "
                      "string.")


def _is_inline(value: str) -> bool:
    return "{{" in value or "{%" in value


def load_chat_template(chat_template: str, tokenizer: str,
                       setting: str = "data.chat_template") -> ChatTemplate:
    """The chat template of a run (see the module docstring): ``chat_template`` (a template
    string or a file) when given, else the one beside the ``tokenizer`` (``data.tokenizer``),
    compiled once to check it. ``setting`` names the option in messages. Raises
    :class:`ConfigError` naming what is missing and what to set."""
    beside = None if tokenizer == "bytes" else Path(tokenizer).expanduser().parent
    config_path = None if beside is None else beside / "tokenizer_config.json"
    config = _read_json(config_path, "data.tokenizer") \
        if config_path is not None and config_path.is_file() else {}
    special = _special_tokens(config)
    if chat_template:
        if _is_inline(chat_template):
            text, origin = chat_template, setting
        else:
            path = Path(chat_template).expanduser()
            try:
                exists = path.is_file()
            except (OSError, ValueError):
                exists = False
            if not exists:
                raise ConfigError(f'{setting} = "{chat_template[:200]}" is neither a Jinja '
                                  "template (it holds no {{ or {%) nor an existing file; give the "
                                  "template's text or the path of a .jinja file or "
                                  "tokenizer_config.json.")
            if path.suffix.lower() == ".json":
                text = _template_of(_read_json(path, setting), path, setting)
                if text is None:
                    raise ConfigError(f"{setting}: {path} has no chat_template field.")
            else:
                try:
                    text = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as error:
                    raise ConfigError(f"{setting}: cannot read {path} ({error}).") from None
            origin = str(path)
    else:
        jinja_file = None if beside is None else beside / "chat_template.jinja"
        if jinja_file is not None and jinja_file.is_file():
            text, origin = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        else:
            text = None if config_path is None else _template_of(config, config_path,
                                                                  "data.tokenizer")
            origin = str(config_path)
        if text is None:
            where = ('data.tokenizer = "bytes" has no tokenizer_config.json' if beside is None
                     else f"neither {beside / 'chat_template.jinja'} nor a chat_template in "
                          f"{config_path} exists")
            raise ConfigError(f"chat data needs a chat template, but {where}; set {setting} "
                              "to a Jinja template or the path of a file holding one.")
    template = ChatTemplate(text, origin, special)
    compile_template(template.text, template.origin)  # refuses a template that does not parse
    return template
