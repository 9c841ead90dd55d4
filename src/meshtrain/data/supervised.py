"""Chat and prompt/completion documents: a ``.jsonl`` row becomes text, the character spans the
loss is taken on, then token ids and a per-token loss mask.

- ``chat``: ``{"messages": [{"role": ..., "content": ...}, ...]}`` (and optionally ``"tools"``)
  rendered with the chat template (:mod:`meshtrain.data.chat_template`); the spans are the
  assistant turns (:func:`~meshtrain.data.chat_template.assistant_spans`).
- ``prompt_completion``: ``{"prompt": "...", "completion": "..."}``; the text is the prompt
  followed by the completion, the span is the completion.

The whole text is tokenized at once (as Hugging Face tokenizes a rendered chat, so the ids do not
depend on where the spans fall) and a token is trained on when the characters it came from
overlap a span (:func:`token_mask`): a token that straddles a span's edge counts as part of it.
The eos id appended after each document is trained on when the document's last token is (a
conversation that ends with an assistant turn, a completion), so the model learns to stop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from meshtrain.config import ConfigError
from meshtrain.data.chat_template import ChatTemplate, TemplateRenderError, assistant_spans

Spans = list[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class DocumentFormat:
    """What a ``.jsonl`` row is (``data.format``) and, for chat, the template rendering it."""

    kind: str = "text"
    """``text``, ``chat`` or ``prompt_completion``."""
    template: ChatTemplate | None = None
    """The chat template (``chat`` only)."""

    @property
    def masked(self) -> bool:
        """Whether documents of this format carry a loss mask."""
        return self.kind != "text"

    def key(self) -> list:
        """What tokenized data of this format depends on beyond the text (cache keys)."""
        return [self.kind, None if self.template is None else self.template.sha256]


def document_format(data) -> DocumentFormat:
    """The :class:`DocumentFormat` of a ``DataConfig`` (loads the chat template for ``chat``)."""
    if data.format != "chat":
        return DocumentFormat(data.format)
    from meshtrain.data.chat_template import load_chat_template

    return DocumentFormat("chat", load_chat_template(data.chat_template, data.tokenizer))


class RowError(ValueError):
    """A row that is not a document of its format (the reader adds the file and line)."""


def _string(row: dict, field: str, what: str) -> str:
    if field not in row:
        raise RowError(f'no "{field}" field; each line of {what} data must be a JSON object '
                       f'like {{"prompt": "...", "completion": "..."}}.')
    if not isinstance(row[field], str):
        raise RowError(f'field "{field}" is {type(row[field]).__name__}, not a string.')
    return row[field]


def _messages(row: dict) -> list:
    messages = row.get("messages")
    if not isinstance(messages, list) or not messages:
        found = ("missing" if "messages" not in row else "an empty list" if messages == []
                 else f"{type(messages).__name__}, not a list")
        raise RowError(f'"messages" is {found}; each line of chat data must be a JSON object '
                       'like {"messages": [{"role": "user", "content": "..."}, {"role": '
                       '"assistant", "content": "..."}]}.')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"message {i} is {type(message).__name__}, not an object with "
                           '"role" and "content".')
        if not isinstance(message.get("role"), str):
            raise RowError(f'message {i} has no string "role".')
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise RowError(f'message {i} ({message["role"]}) has no string "content".')
    return messages


def document_spans(row, fmt: DocumentFormat) -> tuple[str, Spans]:
    """The text of one ``.jsonl`` row of format ``fmt`` and the character spans the loss is
    taken on; :class:`RowError` for a row that is not one (missing or mistyped fields, a
    conversation the template refuses or whose assistant turns cannot be found)."""
    if not isinstance(row, dict):
        raise RowError(f"a {type(row).__name__}, not a JSON object.")
    if fmt.kind == "prompt_completion":
        prompt = _string(row, "prompt", "prompt_completion")
        completion = _string(row, "completion", "prompt_completion")
        text = prompt + completion
        return text, [(len(prompt), len(text))] if completion else []
    if fmt.kind != "chat":
        raise ValueError(f"no spans for data.format = {fmt.kind!r}")
    messages = _messages(row)
    try:
        return assistant_spans(fmt.template, messages, tools=row.get("tools"))
    except TemplateRenderError as error:
        raise RowError(f"{error} (chat template: {fmt.template.origin})") from None


def token_mask(offsets: np.ndarray, spans: Spans) -> np.ndarray:
    """``uint8`` mask of the tokens whose character ranges ``offsets`` (``[n, 2]``, start and
    end) overlap one of ``spans``; a token of no width counts when its position lies in one."""
    mask = np.zeros(len(offsets), dtype=np.uint8)
    if not len(offsets):
        return mask
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    for first, last in spans:
        mask |= ((starts < last) & (ends > first)).astype(np.uint8)
    return mask


def byte_mask(text: str, spans: Spans) -> np.ndarray:
    """The loss mask of the byte tokenizer's tokens of ``text`` (its UTF-8 bytes): the bytes
    of the characters in ``spans``."""
    mask = np.zeros(len(text.encode("utf-8")), dtype=np.uint8)
    for first, last in spans:
        start = len(text[:first].encode("utf-8"))
        mask[start:start + len(text[first:last].encode("utf-8"))] = 1
    return mask


def encode_masked(documents: list[tuple[str, Spans]], tokenizer
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(ids, mask)`` of each ``(text, spans)``: the whole text tokenized (no special tokens
    added) and :func:`token_mask` of its spans; no eos appended."""
    from meshtrain.data.tokenizer import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return [(tokenizer.encode_array(text).astype(np.int64), byte_mask(text, spans))
                for text, spans in documents]
    if not hasattr(tokenizer, "encode_batch_offsets"):
        raise ConfigError(f"the tokenizer {tokenizer.name} gives no character offsets, which "
                          "chat and prompt_completion data need to find the trained tokens.")
    encoded = tokenizer.encode_batch_offsets([text for text, _ in documents])
    return [(np.asarray(ids, dtype=np.int64),
             token_mask(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), spans))
            for (ids, offsets), (_, spans) in zip(encoded, documents, strict=True)]


def masked_rows(path, fmt: DocumentFormat, start: int = 0, end: int | None = None,
                report=None):
    """``(text, spans)`` of each row in bytes ``[start, end)`` of the ``.jsonl`` file ``path``
    (:func:`document_spans`); :class:`ConfigError` naming the file and line of a bad row."""
    from meshtrain.data.readers import jsonl_objects, line_of

    for number, row in jsonl_objects(path, start, end, report):
        try:
            yield document_spans(row, fmt)
        except RowError as error:
            raise ConfigError(f"{path}, line {line_of(path, start, number)}: {error}") from None
