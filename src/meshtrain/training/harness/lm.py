"""meshtrain's model as the lm-evaluation-harness's language model.

:class:`MeshtrainLM` subclasses the harness's ``TemplateLM``, which turns text requests into
token ids with :meth:`MeshtrainLM.tok_encode` (meshtrain's tokenizer, no special tokens added)
and splits a context from its continuation as every harness model does; this class scores and
generates with a one-device :class:`~meshtrain.model.transformer.Transformer`:

- **log-likelihood** (multiple choice, ``loglikelihood``): the summed log-probability of the
  continuation's tokens after the context, and whether each was the greedy choice; requests are
  sorted by length and run ``batch_size`` at a time, right-padded (the model is causal, so padding
  after a sequence changes none of its logits). An empty context is conditioned on the
  end-of-sequence token, as are the first tokens of a rolling window.
- **rolling log-likelihood** (perplexity tasks): a text cut into windows of at most
  :attr:`max_length` tokens, each token predicted once (the harness's
  ``get_rolling_token_windows``), the windows batched like the requests above.
- **generation** (``generate_until``): greedy decoding, batched, until a stop sequence appears,
  the end-of-sequence token comes, or ``max_gen_toks`` tokens; the context is cut from the left to
  ``max_length - max_gen_toks`` tokens and the answer cut before its first stop sequence. Sampling
  (``do_sample``, a temperature above 0) is refused.

:attr:`max_length` is the context the weights were trained or published with (the
``max_position_embeddings`` that ``meshtrain convert --to-hf`` writes), so windows and cuts fall
where they fall for the exported model under ``lm_eval --model hf``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from meshtrain.config import ConfigError

Request = tuple[tuple[str, str] | None, list[int], list[int]]
"""``(cache key, context ids, continuation ids)``, as the harness's ``TemplateLM`` passes them."""

DEFAULT_MAX_GEN_TOKS = 256
"""Tokens a generation task may produce when it does not say (the harness's default)."""


class MeshtrainLM(TemplateLM):
    """A loaded meshtrain model and its tokenizer, scored by the harness (see the module)."""

    def __init__(self, model, tokenizer, max_length: int, batch_size: int = 16):
        super().__init__()
        self.model = model.eval()
        self.text_tokenizer = tokenizer
        self._max_length = int(max_length)
        self.batch_size = max(int(batch_size), 1)
        self._device = next(model.parameters()).device

    # -------------------------------------------------------------- what the harness reads
    @property
    def eot_token_id(self) -> int:
        """The tokenizer's end-of-sequence id (the harness's end-of-text token)."""
        eos = self.text_tokenizer.eos_id
        if eos is None:
            raise ConfigError(f"the tokenizer {self.text_tokenizer.name} has no end-of-sequence "
                              "token, which an empty context and rolling log-likelihood are "
                              "conditioned on; use a tokenizer.json with one (e.g. "
                              "<|endoftext|>) or tasks whose contexts are never empty.")
        return eos

    @property
    def max_length(self) -> int:
        """The longest sequence the model is shown (see the module docstring)."""
        return self._max_length

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs
                   ) -> list[int]:
        """meshtrain's token ids of ``string`` (its tokenizers add no special tokens)."""
        return self.text_tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs) -> str:
        """The text of ``tokens``."""
        return self.text_tokenizer.decode(tokens)

    # -------------------------------------------------------------- scoring
    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """fp32 logits [B, longest, vocab] of right-padded ``rows``."""
        longest = max(len(row) for row in rows)
        tokens = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return self.model(tokens.to(self._device)).float()

    def _loglikelihood_tokens(self, requests: list[Request], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """``(summed log-probability, all greedy)`` of each request's continuation."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        inputs = []
        for index, (_, context, continuation) in enumerate(requests):
            whole = (context + continuation)[-(self._max_length + 1):]
            scored = min(len(continuation), len(whole) - 1)  # a window holds at most this many
            inputs.append((index, whole[:-1], whole[len(whole) - scored:] if scored > 0 else []))
        inputs.sort(key=lambda item: -len(item[1]))
        batch = override_bs or self.batch_size
        for start in range(0, len(inputs), batch):
            chunk = inputs[start:start + batch]
            logits = self._logits([row for _, row, _ in chunk])
            for b, (index, row, targets) in enumerate(chunk):
                if not targets:
                    results[index] = (0.0, True)
                    continue
                span = logits[b, len(row) - len(targets):len(row)]
                log_probs = F.log_softmax(span, dim=-1)
                target = torch.tensor(targets, device=span.device)
                score = float(log_probs.gather(-1, target[:, None]).sum())
                greedy = bool((span.argmax(-1) == target).all())
                results[index] = (score, greedy)
                key = requests[index][0]
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, results[index])
        return results  # type: ignore[return-value]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-likelihood of each whole text, window by window (see the module)."""
        windows: list[Request] = []
        owners: list[int] = []
        for index, request in enumerate(requests):
            (text,) = request.args
            for context, targets in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.eot_token_id,
                    max_seq_len=self._max_length, context_len=1)):
                windows.append((None, context, targets))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._loglikelihood_tokens(windows), strict=True):
            totals[owner] += score
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # -------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations, each cut before its first stop sequence (see the module)."""
        answers: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        settings = []
        for index, request in enumerate(requests):
            context, kwargs = request.args
            until, max_new = _greedy_settings(kwargs or {})
            settings.append((context, until, max_new))
            groups.setdefault((tuple(until), max_new), []).append(index)
        for (until, max_new), indices in groups.items():
            room = self._max_length - max_new
            if room < 1:
                raise ConfigError(f"a generation task asks for up to {max_new} new tokens, but "
                                  f"the model's context is {self._max_length} tokens; lower the "
                                  "task's generation_kwargs max_gen_toks below it.")
            indices.sort(key=lambda i: -len(settings[i][0]))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                prompts = [self.tok_encode(settings[i][0])[-room:] for i in chunk]
                for i, text in zip(chunk, self._greedy(prompts, list(until), max_new),
                                   strict=True):
                    answers[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return answers  # type: ignore[return-value]

    @torch.no_grad()
    def _greedy(self, prompts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Decode each prompt greedily, all of them in one right-padded batch per token."""
        eos = self.text_tokenizer.eos_id
        rows = [list(p) if p else [self.eot_token_id] for p in prompts]
        starts = [len(row) for row in rows]
        done = [False] * len(rows)
        for _ in range(max_new):
            live = [i for i, finished in enumerate(done) if not finished]
            if not live:
                break
            logits = self._logits([rows[i] for i in live])
            for b, i in enumerate(live):
                token = int(logits[b, len(rows[i]) - 1].argmax())
                if eos is not None and token == eos:
                    done[i] = True
                    continue
                rows[i].append(token)
                if until and any(s in self.tok_decode(rows[i][starts[i]:]) for s in until):
                    done[i] = True
        return [_cut(self.tok_decode(row[start:]), until)
                for row, start in zip(rows, starts, strict=True)]


def _greedy_settings(kwargs: dict) -> tuple[list[str], int]:
    """``(stop sequences, most new tokens)`` of a task's ``generation_kwargs``; sampling is
    refused (meshtrain's harness model decodes greedily)."""
    if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
        raise ConfigError("a generation task asks for sampling (do_sample / temperature > 0); "
                          "meshtrain eval decodes greedily: set do_sample: false in the task's "
                          "generation_kwargs.")
    until = kwargs.get("until") or []
    until = [until] if isinstance(until, str) else list(until)
    for key in ("max_gen_toks", "max_new_tokens", "max_tokens"):
        if kwargs.get(key) is not None:
            return until, int(kwargs[key])
    return until, DEFAULT_MAX_GEN_TOKS


def _cut(text: str, until: list[str]) -> str:
    """``text`` up to the first occurrence of any stop sequence."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text
