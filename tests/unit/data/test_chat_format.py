"""Chat and prompt/completion data: rendering with chat templates, the assistant spans, and the
per-token loss masks, against hand-written expectations (byte tokenizer and a small BPE
tokenizer trained here), plus the errors a bad template, row or setting gets."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data.chat_template import ChatTemplate, load_chat_template, render
from meshtrain.data.encoding import Encoder
from meshtrain.data.supervised import (
    DocumentFormat,
    document_format,
    document_spans,
    masked_rows,
)
from meshtrain.data.tokenizer import ByteTokenizer, load_tokenizer

CHATML = ("{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
          "{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML again, but the template marks what the assistant generates (Hugging Face's convention).
CHATML_MARKED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}"
                 "{{ '<|im_start|>assistant\n' }}"
                 "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
                 "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_STYLE = ("{{ bos_token }}{% for message in messages %}"
                "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' "
                "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
                "{% if add_generation_prompt %}"
                "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "How are you?"},
                {"role": "assistant", "content": "Fine, thanks."},
                {"role": "user", "content": "Bye?"},
                {"role": "assistant", "content": "Bye."}]


def chat(template: str) -> DocumentFormat:
    return DocumentFormat("chat", ChatTemplate(template, "test"))


def encode(rows: list, fmt: DocumentFormat, tokenizer=None) -> tuple[np.ndarray, np.ndarray]:
    """Ids and loss mask of ``rows`` as prepare writes them (each followed by eos)."""
    encoder = Encoder(tokenizer or ByteTokenizer(), "<u4")
    ids, _, mask = encoder.masked_documents([document_spans(row, fmt) for row in rows])
    return ids.astype(np.int64), mask


def expected_bytes(segments: list[tuple[str, int]], eos_trained: int) -> tuple[list, list]:
    """Byte-tokenizer ids and mask of ``(text, trained)`` segments, then eos (256)."""
    ids, mask = [], []
    for text, trained in segments:
        ids += list(text.encode())
        mask += [trained] * len(text.encode())
    return ids + [256], mask + [eos_trained]


def test_chatml_masks_each_assistant_turn_and_its_end_with_the_byte_tokenizer():
    ids, mask = encode([{"messages": CONVERSATION}], chat(CHATML))
    want_ids, want_mask = expected_bytes([
        ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Fine, thanks.<|im_end|>\n", 1),
        ("<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Bye.<|im_end|>\n", 1)], eos_trained=1)
    assert ids.tolist() == want_ids
    assert mask.tolist() == want_mask


def test_a_conversation_ending_with_the_user_trains_neither_its_end_nor_its_eos():
    ids, mask = encode([{"messages": CONVERSATION[:4]}], chat(CHATML))
    assert mask[-1] == 0 and ids[-1] == 256
    trained = bytes(int(i) for i, m in zip(ids, mask, strict=True) if m)
    assert trained == b"Fine, thanks.<|im_end|>\n"


def test_generation_markers_give_exactly_the_marked_characters():
    ids, mask = encode([{"messages": CONVERSATION}], chat(CHATML_MARKED))
    plain_ids, _ = encode([{"messages": CONVERSATION}], chat(CHATML))
    assert ids.tolist() == plain_ids.tolist()  # the markers change no character
    want_ids, want_mask = expected_bytes([
        ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n"
         "<|im_start|>assistant\n", 0),
        ("Fine, thanks.<|im_end|>", 1),
        ("\n<|im_start|>user\nBye?<|im_end|>\n<|im_start|>assistant\n", 0),
        ("Bye.<|im_end|>", 1), ("\n", 0)], eos_trained=0)
    assert mask.tolist() == want_mask and ids.tolist() == want_ids


def _bpe(directory: Path, special: list[str], config: dict | None = None) -> str:
    """A byte-level BPE tokenizer.json trained here (no download), and its
    tokenizer_config.json when ``config`` is given."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["Fine, thanks. How are you? Be terse. Bye."] * 30, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return str(directory / "tokenizer.json")


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]


def test_llama3_style_template_from_tokenizer_config_with_a_bpe_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    path = _bpe(tmp_path / "llama", LLAMA3_SPECIAL, {
        "chat_template": LLAMA3_STYLE, "bos_token": "<|begin_of_text|>",
        "eos_token": {"content": "<|eot_id|>", "special": True}})
    fmt = document_format(DataConfig(tokenizer=path, format="chat"))
    assert fmt.template.origin.endswith("tokenizer_config.json")
    rows = [{"messages": [dict(m, content=f"  {m['content']} ") for m in CONVERSATION]}]
    text, _ = document_spans(rows[0], fmt)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nFine, thanks.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nBye?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nBye.<|eot_id|>")
    ids, mask = encode(rows, fmt, load_tokenizer(path))
    raw = Tokenizer.from_file(path)
    decode = lambda keep: raw.decode([int(i) for i, m in zip(ids, mask, strict=True)  # noqa: E731
                                      if m == keep], skip_special_tokens=False)
    assert decode(1) == "Fine, thanks.<|eot_id|>Bye.<|eot_id|><|end_of_text|>"
    assert decode(0) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHow are you?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
        "<|start_header_id|>user<|end_header_id|>\n\nBye?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    eot = raw.token_to_id("<|eot_id|>")
    assert [int(m) for i, m in zip(ids, mask, strict=True) if i == eot] == [0, 0, 1, 0, 1]


def test_generation_mask_equals_hugging_face_assistant_tokens_mask(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = _bpe(tmp_path / "chatml", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                {"chat_template": CHATML_MARKED, "eos_token": "<|endoftext|>"})
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>")
    out = hf.apply_chat_template(CONVERSATION, chat_template=CHATML_MARKED, tokenize=True,
                                 return_dict=True, return_assistant_tokens_mask=True)
    fmt = document_format(DataConfig(tokenizer=path, format="chat"))
    ids, mask = encode([{"messages": CONVERSATION}], fmt, load_tokenizer(path))
    assert ids[:-1].tolist() == list(out["input_ids"])  # the eos meshtrain appends aside
    assert mask[:-1].tolist() == list(out["assistant_masks"])
    assert 0 < mask.sum() < len(mask)


# A template that renders earlier assistant turns differently once later turns follow (as
# templates that drop earlier reasoning do): message-by-message rendering cannot find the spans.
REWRITES_EARLIER = ("{% for m in messages %}{{ '<' + m['role'] + '>' }}"
                    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'][:2] }}"
                    "{% else %}{{ m['content'] }}{% endif %}{{ '</>' }}{% endfor %}"
                    "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_file_line_and_message(
        tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATION[1:3]}) + "\n\n"
                      + json.dumps({"messages": CONVERSATION}) + "\n")
    fmt = chat(REWRITES_EARLIER)
    first_line = len(source.read_bytes().split(b"\n")[0]) + 1
    assert len(list(masked_rows(source, fmt, 0, first_line))) == 1  # one assistant turn: fine
    with pytest.raises(ConfigError, match=rf"{source}, line 3: message 2 \(assistant\)") as error:
        list(masked_rows(source, fmt))
    assert "{% generation %}" in str(error.value)
    # the same rendering with markers is accepted
    marked = ("{% for m in messages %}{{ '<' + m['role'] + '>' }}"
              "{% if m['role'] == 'assistant' %}{% generation %}"
              "{% if not loop.last %}{{ m['content'][:2] }}{% else %}{{ m['content'] }}{% endif %}"
              "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '</>' }}{% endfor %}")
    rows = list(masked_rows(source, chat(marked)))
    assert [[text[a:b] for a, b in spans] for text, spans in rows] == [
        ["Fine, thanks."], ["Fi", "Bye."]]


def test_prompt_completion_trains_the_completion_and_the_eos():
    ids, mask = encode([{"prompt": "Q: 2+2?\nA:", "completion": " 4"},
                        {"prompt": "Q: é?", "completion": ""}],
                       DocumentFormat("prompt_completion"))
    first, second = expected_bytes([("Q: 2+2?\nA:", 0), (" 4", 1)], 1), \
        expected_bytes([("Q: é?", 0)], 0)
    assert ids.tolist() == first[0] + second[0]
    assert mask.tolist() == first[1] + second[1]


@pytest.mark.parametrize(("row", "message"), [
    ('{"prompt": "x"}', 'no "completion" field'),
    ('{"prompt": 3, "completion": "y"}', 'field "prompt" is int'),
    ('["prompt", "completion"]', "not a JSON object"),
    ('{"prompt": "x", "completion": "y"', "not valid JSON"),
])
def test_bad_prompt_completion_rows_name_the_file_and_line(tmp_path, row, message):
    source = tmp_path / "pc.jsonl"
    source.write_text('{"prompt": "a", "completion": "b"}\n' + row + "\n")
    with pytest.raises(ConfigError, match=rf"{source}, line 2: .*{message}"):
        list(masked_rows(source, DocumentFormat("prompt_completion")))


@pytest.mark.parametrize(("row", "message"), [
    ({"text": "hi"}, '"messages" is missing'),
    ({"messages": []}, '"messages" is an empty list'),
    ({"messages": "hi"}, '"messages" is str, not a list'),
    ({"messages": [{"content": "hi"}]}, 'message 0 has no string "role"'),
    ({"messages": [{"role": "user", "content": 1}]}, r'message 0 \(user\) has no string'),
    ({"messages": ["hi"]}, "message 0 is str"),
])
def test_bad_chat_rows_name_the_file_and_line(tmp_path, row, message):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=rf"{source}, line 2: {message}"):
        list(masked_rows(source, chat(CHATML)))


def test_the_sandbox_and_raise_exception_refuse_rows_with_file_and_line(tmp_path):
    source = tmp_path / "chat.jsonl"
    source.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    for template, message in [
            ("{{ messages.append(1) }}", "sandbox refuses"),
            ("{{ ''.__class__.__mro__ }}", "sandbox refuses"),
            ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system "
             "prompts') }}{% endif %}", "refused it: no system prompts")]:
        with pytest.raises(ConfigError, match=rf"{source}, line 1: .*{message}"):
            list(masked_rows(source, chat(template)))


def test_hugging_face_helpers_tojson_strftime_and_special_tokens():
    template = ChatTemplate("{{ bos_token }}{{ messages[0] | tojson }}"
                            "{{ messages[0]['content'] | tojson(indent=1) }}"
                            "{{ strftime_now('%Y') | length }}{% for m in messages %}"
                            "{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}",
                            "test", (("bos_token", "<s>"),))
    out = render(template, [{"role": "u", "content": "é<b>"}, {"role": "v", "content": ""}])
    assert out == '<s>{"role": "u", "content": "é<b>"}"é<b>"4u'


def test_where_the_template_comes_from(tmp_path):
    path = _bpe(tmp_path / "tok", ["<|endoftext|>"], {
        "chat_template": [{"name": "tool_use", "template": "T{{ 1 }}"},
                          {"name": "default", "template": "D{{ 1 }}"}],
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "model_max_length": 5})
    loaded = load_chat_template("", path)
    assert loaded.text == "D{{ 1 }}" and dict(loaded.special_tokens) == {
        "bos_token": "<s>", "eos_token": "</s>"}
    (tmp_path / "tok" / "chat_template.jinja").write_text("J{{ 2 }}")
    assert load_chat_template("", path).text == "J{{ 2 }}"  # the .jinja file comes first
    assert load_chat_template("X{{ 3 }}", path).text == "X{{ 3 }}"  # the setting overrides
    (tmp_path / "mine.jinja").write_text("F{{ 4 }}")
    assert load_chat_template(str(tmp_path / "mine.jinja"), path).text == "F{{ 4 }}"
    assert load_chat_template(str(tmp_path / "tok" / "tokenizer_config.json"),
                              "bytes").text == "D{{ 1 }}"


@pytest.mark.parametrize(("chat_template", "message"), [
    ("", 'data.tokenizer = "bytes" has no tokenizer_config.json'),
    ("/nonexistent/template.jinja", "neither a Jinja template"),
    ("x" * 5000, "neither a Jinja template"),
    ("a\x00b", "neither a Jinja template"),
    ("{% for m in messages %}", "does not parse"),
])
def test_templates_that_cannot_be_had_are_config_errors(chat_template, message):
    with pytest.raises(ConfigError, match=message):
        load_chat_template(chat_template, "bytes")


def test_a_tokenizer_without_a_template_beside_it_names_both_places(tmp_path):
    path = _bpe(tmp_path / "bare", ["<|endoftext|>"])
    with pytest.raises(ConfigError, match="neither .*chat_template.jinja nor a chat_template"):
        load_chat_template("", path)


def test_a_token_belongs_to_a_span_when_its_characters_overlap_it():
    from meshtrain.data.supervised import token_mask

    offsets = np.array([[0, 3], [3, 6], [6, 6], [6, 9], [9, 12], [12, 14]])
    # the span [5, 10) touches tokens 1 (3-6, straddling its start), 2 (no width, at 6),
    # 3 (inside) and 4 (9-12, straddling its end)
    assert token_mask(offsets, [(5, 10)]).tolist() == [0, 1, 1, 1, 1, 0]
    assert token_mask(offsets, [(0, 3), (13, 14)]).tolist() == [1, 0, 0, 0, 0, 1]
    assert token_mask(offsets, []).tolist() == [0] * 6
