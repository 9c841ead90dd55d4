"""The per-token loss mask from disk to the loss: stored beside the tokens by prepare and by the
token cache, kept aligned through slicing, held-out tails and mixtures, turned into ignored
targets by packing, and normalised by trained tokens only; the settings that select it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from meshtrain.config import ConfigError, DataConfig
from meshtrain.data.packing import IGNORE_INDEX, PackedDataset, hold_out_tail
from meshtrain.data.prepare import prepare
from meshtrain.data.prepared import data_format_of, open_prepared_stream, read_meta
from meshtrain.data.shards import TokenShards
from meshtrain.data.sources import CACHE_ENV, load_token_stream
from meshtrain.data.tokenizer import ByteTokenizer
from tests.chat_data import CHATML, chat_settings, conversation, write_chat_jsonl
from tests.helpers import tiny_config


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    """Raw sources are tokenized into a cache of this test's own."""
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "token-cache"))
    return tmp_path / "token-cache"


def chat_data(source: str, **changes) -> DataConfig:
    return DataConfig(source=source, format="chat", chat_template=CHATML, **changes)


def stream_and_mask(tokens: TokenShards) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(tokens.tolist()), tokens.mask_window(0, len(tokens))


def test_packing_ignores_exactly_the_masked_targets_across_shards():
    ids = [np.arange(10, 17, dtype=np.uint16), np.arange(20, 30, dtype=np.uint16)]
    masks = [np.array([0, 0, 1, 1, 0, 1, 1], np.uint8), None]  # None: all trained
    stream = TokenShards(ids, masks)
    packed = PackedDataset(stream, 4)
    inputs, targets = packed.batch([0, 1, 2])
    everything = np.concatenate(ids).astype(np.int64)
    mask = np.concatenate([masks[0], np.ones(10, np.uint8)])
    for row, index in enumerate([0, 1, 2]):
        window = slice(index * 4 + 1, index * 4 + 5)
        assert inputs[row].tolist() == everything[index * 4:index * 4 + 4].tolist()
        want = np.where(mask[window] == 1, everything[window], IGNORE_INDEX)
        assert targets[row].tolist() == want.tolist()
        single = packed[index]
        assert torch.equal(single[0], inputs[row]) and torch.equal(single[1], targets[row])
    assert (targets == IGNORE_INDEX).sum() == 2  # positions 1 and 4 (0 is never a target)
    # slices, held-out tails and concatenations keep each mask with its tokens
    part = stream.slice(3, 12)
    assert part.tolist() == everything[3:12].tolist()
    assert part.mask_window(0, 9).tolist() == (mask[3:12] == 1).tolist()
    train, held = hold_out_tail(stream, 0.3, eos_id=None)
    joined = TokenShards.concat([held, train])
    assert joined.mask_window(0, len(joined)).tolist() == (
        np.concatenate([mask[len(train):], mask[:len(train)]]) == 1).tolist()
    assert not TokenShards.concat([TokenShards([ids[1]])]).has_mask
    assert stream.without_mask().mask_window(0, 5) is None


def test_prepare_stores_the_mask_beside_the_tokens_and_training_reads_it_back(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", rows=120)
    out = tmp_path / "prepared"
    meta = prepare([source], out, data_format="chat", chat_template=CHATML, shard_bytes=3000,
                   workers=2)
    assert meta["data_format"] == "chat" and meta["loss_mask"] == "uint8"
    assert data_format_of(out) == "chat" and len(meta["shards"]) > 2
    for shard in meta["shards"]:  # one uint8 per token, 0 or 1
        mask = np.fromfile(out / shard["mask"], dtype=np.uint8)
        assert shard["mask"] == shard["file"].replace(".bin", ".mask")
        assert len(mask) == shard["tokens"] and set(np.unique(mask)) <= {0, 1}
    prepared_ids, prepared_mask = stream_and_mask(open_prepared_stream(out, ByteTokenizer()))
    raw_ids, raw_mask = stream_and_mask(load_token_stream(chat_data(source), ByteTokenizer()))
    assert prepared_ids.tolist() == raw_ids.tolist()  # the token cache is the same corpus
    assert prepared_mask.tolist() == raw_mask.tolist()
    # hand-checked: every trained stretch is assistant text, its end, and the eos after it
    text = bytes(int(i) if i < 256 else ord("~") for i in prepared_ids[prepared_mask])
    turns = [m["content"] + "<|im_end|>\n" for row in map(json.loads, open(source))
             for m in row["messages"] if m["role"] == "assistant"]
    assert text.decode().replace("~", "") == "".join(turns)
    assert int(prepared_mask.sum()) == len(text)
    # one worker, the same bytes; a second run is up to date
    again = prepare([source], tmp_path / "one", data_format="chat", chat_template=CHATML,
                    shard_bytes=3000)
    for shard in again["shards"]:
        for name in (shard["file"], shard["mask"]):
            assert (tmp_path / "one" / name).read_bytes() == (out / name).read_bytes()
    assert prepare([source], out, data_format="chat", chat_template=CHATML,
                   shard_bytes=3000, workers=2)["up_to_date"]
    # train_on = "all" reads the same tokens without the mask
    assert not load_token_stream(DataConfig(source=str(out), train_on="all"),
                                 ByteTokenizer()).has_mask


def test_a_damaged_mask_file_is_refused(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", rows=20)
    out = tmp_path / "prepared"
    meta = prepare([source], out, data_format="chat", chat_template=CHATML)
    mask = out / meta["shards"][0]["mask"]
    mask.write_bytes(mask.read_bytes()[:-1])
    with pytest.raises(ConfigError, match=r"shard-00000\.mask: missing or not"):
        open_prepared_stream(out, ByteTokenizer())


def test_prepare_refuses_other_formats_and_non_jsonl_files(tmp_path):
    (tmp_path / "a.txt").write_text("plain text\n")
    with pytest.raises(ConfigError, match=r"a\.txt: data.format = \"prompt_completion\" reads "
                                          r"\.jsonl files only"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", data_format="prompt_completion")
    with pytest.raises(ConfigError, match='--format "dialogue" is not one of text, chat, '
                                          "prompt_completion"):
        prepare([str(tmp_path / "a.txt")], tmp_path / "out", data_format="dialogue")


def _trainer(*overrides: str):
    from meshtrain.parallel.mesh import ParallelMesh
    from meshtrain.training.trainer import Trainer

    return Trainer(tiny_config(*overrides), ParallelMesh())


def _gradients(trainer, microbatches) -> tuple[dict, list]:
    from meshtrain.commands.verify_grads import gather_gradients

    result = trainer.compute_gradients(microbatches)
    gradients = gather_gradients(trainer)
    trainer.optimizer.zero_grad()
    return result, gradients


def test_micro_batches_whose_targets_are_all_masked_contribute_nothing(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl")
    trainer = _trainer(*chat_settings(source), "train.seq_len=64", "parallel.microbatches=2")
    first, _ = trainer.data.next_step()
    masked_a = (torch.randint(0, 256, first[0].shape), torch.full_like(first[1], IGNORE_INDEX))
    masked_b = (torch.randint(0, 256, first[0].shape), torch.full_like(first[1], IGNORE_INDEX))
    with_a, grads_a = _gradients(trainer, [first, masked_a])
    with_b, grads_b = _gradients(trainer, [first, masked_b])
    alone, grads_alone = _gradients(trainer, [first])
    assert with_a["global_tokens"] == alone["global_tokens"] == int((first[1] >= 0).sum()) > 0
    assert float(with_a["lm"]) == float(with_b["lm"]) == float(alone["lm"]) > 0
    for (name, _, a), (_, _, b), (_, _, c) in zip(grads_a, grads_b, grads_alone, strict=True):
        assert np.array_equal(a, b) and np.array_equal(a, c), name
    # a whole global batch with no target: zero loss and zero gradients, not NaN
    nothing, grads = _gradients(trainer, [masked_a, masked_b])
    assert nothing["global_tokens"] == 0 and float(nothing["lm"]) == 0.0
    assert all(np.all(g == 0) for _, _, g in grads)
    trainer.batches.next_step = lambda: ([masked_a, masked_b], 0)
    record = trainer.train_step()
    assert (record["loss"], record["grad_norm"], record["tokens"]) == (0.0, 0.0, 0)
    assert trainer.nonfinite.total_skipped == 0
    # throughput counts the tokens run through the model, not the loss's targets
    train = trainer.config.train
    assert record["tokens_processed"] == train.seq_len * train.global_batch > 0
    assert record["tokens_per_s"] == record["tokens_processed"] / record["step_time_s"]


def test_assistant_text_changes_the_loss_and_system_text_changes_no_target(tmp_path):
    import random

    base = conversation(random.Random(3))
    system = json.loads(json.dumps(base))
    system["messages"][0]["content"] = system["messages"][0]["content"].upper()  # same length
    assistant = json.loads(json.dumps(base))
    assistant["messages"][2]["content"] = assistant["messages"][2]["content"].upper()
    streams = {}
    for name, row in (("base", base), ("system", system), ("assistant", assistant)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(json.dumps(row) + "\n")
        streams[name] = load_token_stream(chat_data(str(path)), ByteTokenizer())
    ids = {name: np.asarray(s.tolist()) for name, s in streams.items()}
    masks = {name: s.mask_window(0, len(s)) for name, s in streams.items()}
    assert masks["base"].tolist() == masks["system"].tolist() == masks["assistant"].tolist()
    assert 0 < masks["base"].sum() < len(masks["base"])
    changed_by_system = ids["base"] != ids["system"]
    changed_by_assistant = ids["base"] != ids["assistant"]
    assert changed_by_system.any() and not (changed_by_system & masks["base"]).any()
    assert changed_by_assistant.any() and (changed_by_assistant <= masks["base"]).all()
    seq = len(ids["base"]) - 1
    trainer = _trainer("train.seq_len=16")
    batch = {name: PackedDataset(s, seq).batch([0]) for name, s in streams.items()}

    def loss(inputs, targets) -> float:
        with torch.no_grad():
            return float(trainer.token_loss_sum(trainer.model(inputs), targets))

    # the system prompt is context, never a target: the same targets, and with the base inputs
    # the same loss; taking the loss on every token instead would see the change
    assert torch.equal(batch["base"][1], batch["system"][1])
    assert loss(batch["base"][0], batch["system"][1]) == loss(*batch["base"])
    everything = {name: PackedDataset(s.without_mask(), seq).batch([0])
                  for name, s in streams.items()}
    assert not torch.equal(everything["base"][1], everything["system"][1])
    assert loss(everything["base"][0], everything["system"][1]) != loss(*everything["base"])
    # the assistant's text is what the loss is taken on
    assert not torch.equal(batch["base"][1], batch["assistant"][1])
    assert abs(loss(*batch["assistant"]) - loss(*batch["base"])) > 1e-3


def test_the_loss_is_the_mean_over_trained_tokens_of_the_whole_batch(tmp_path):
    source = write_chat_jsonl(tmp_path / "chat.jsonl")
    trainer = _trainer(*chat_settings(source), "train.seq_len=64", "parallel.microbatches=2")
    micro, local = trainer.batches.next_step()
    trained = sum(int((y != IGNORE_INDEX).sum()) for _, y in micro)
    assert local == trained < sum(y.numel() for _, y in micro)
    with torch.no_grad():
        total = sum(float(torch.nn.functional.cross_entropy(
            trainer.model(x).flatten(0, 1), y.flatten(), reduction="sum",
            ignore_index=IGNORE_INDEX)) for x, y in micro)
    result, _ = _gradients(trainer, micro)
    assert result["global_tokens"] == trained
    assert float(result["lm"]) == pytest.approx(total / trained, rel=1e-5)


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.format=dialogue"], 'data.format = "dialogue" is not a data format; valid: "text", '
                               '"chat", "prompt_completion"'),
    (["data.train_on=prompts"], 'data.train_on = "prompts" is not valid; valid: "assistant", '
                                '"all"'),
    (["data.chat_template={{ x }}"], 'data.chat_template is set but data.format = "text"'),
    (["data.format=chat"], 'data.tokenizer = "bytes" has no tokenizer_config.json'),
    (["data.format=prompt_completion"], "data.source is the built-in corpus"),
    (["data.format=chat", "data.chat_template=/nonexistent/chat.jinja"],
     "neither a Jinja template"),
    (["data.format=chat", "data.chat_template={% if %}"], "does not parse"),
])
def test_settings_are_validated_with_the_valid_values(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("{", r"\{")):
        tiny_config(*overrides)


def test_raw_sources_of_rows_must_be_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("text\n" * 100)
    with pytest.raises(ConfigError, match=r"data.source holds .*a\.txt; give \.jsonl files"):
        tiny_config(f"data.source={tmp_path / 'a.txt'}", "data.format=prompt_completion")
    source = write_chat_jsonl(tmp_path / "chat.jsonl", rows=5)
    with pytest.raises(ConfigError, match=r"data.valid_source holds .*a\.txt"):
        tiny_config(*chat_settings(source), f"data.valid_source={tmp_path / 'a.txt'}",
                    "train.eval_every=1")


def test_the_prepare_command_and_raw_sources_name_a_bad_row(tmp_path, meshtrain, token_cache):
    source = write_chat_jsonl(tmp_path / "chat.jsonl", rows=10)
    done = meshtrain("prepare", source, "--out", str(tmp_path / "out"), "--format", "chat",
                     "--chat-template", CHATML)
    assert done.returncode == 0 and "chat with a loss mask" in done.stdout
    assert read_meta(tmp_path / "out")["data_format"] == "chat"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(source).readline() + '{"messages": [{"role": "user"}]}\n')
    refused = meshtrain("prepare", str(bad), "--out", str(tmp_path / "bad-out"), "--format",
                        "chat", "--chat-template", CHATML)
    assert refused.returncode == 2
    assert f'{bad}, line 2: message 0 (user) has no string "content"' in " ".join(
        refused.stderr.split())
    with pytest.raises(ConfigError, match=rf"{bad}, line 2: message 0"):
        load_token_stream(chat_data(str(bad)), ByteTokenizer())
    assert not list(token_cache.glob("tokens-*/COMPLETE"))  # nothing complete was left behind


def test_a_mixture_of_chat_and_text_keeps_each_source_s_mask(tmp_path):
    from meshtrain.config import TrainConfig
    from meshtrain.data.mixture import mixture_data

    chat_dir = tmp_path / "chat-prepared"
    prepare([write_chat_jsonl(tmp_path / "chat.jsonl", rows=60)], chat_dir, data_format="chat",
            chat_template=CHATML)
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"plain document {i} " * 5}) + "\n"
                            for i in range(60)))
    data = DataConfig(source="builtin", valid_fraction=0.1,
                      sources=[{"path": str(chat_dir), "weight": 0.5},
                               {"path": str(text), "weight": 0.5}])
    tokens, held, dataset, _ = mixture_data(data, TrainConfig(seq_len=32, global_batch=4),
                                            ByteTokenizer(), 0, 1, 1)
    chat_samples, text_samples = len(dataset.datasets[0]), len(dataset.datasets[1])
    _, chat_targets = dataset.batch(list(range(chat_samples)))
    _, text_targets = dataset.batch(list(range(chat_samples, chat_samples + text_samples)))
    assert (chat_targets == IGNORE_INDEX).any() and (chat_targets != IGNORE_INDEX).any()
    assert not (text_targets == IGNORE_INDEX).any()
    assert tokens.has_mask and held.has_mask  # the joined streams keep the chat part's mask
    held_mask = held.mask_window(0, len(held))
    assert not held_mask.all() and held_mask[-10:].all()  # the text source's tail: all trained
