"""Tokenization with the model's own tokenizer and chat template, and the loss mask.

Labels follow HF's convention (the engine shifts: token t is trained to predict labels[t + 1]):
``labels[t] = input_ids[t]`` where token t is trained as a target, ``IGNORE_INDEX`` elsewhere.

- chat (messages, alpaca): only assistant turns are targets, each with its end-of-turn token, so the model
  learns to answer and to stop. When the chat template marks assistant turns with ``{% generation %}``,
  transformers returns the mask itself (``return_assistant_tokens_mask``). Otherwise the conversation
  is rendered up to each assistant turn (with and without the turn) and the characters in between are
  mapped to tokens through the fast tokenizer's offsets, which is robust to merges at the boundary.
- text: every token is a target; eos is appended so packed documents end like they do in pretraining.
- ``train_on_inputs``: every token of a chat is a target, prompts and template markup too (axolotl's and
  LLaMA-Factory's switch of that name); an assistant turn of weight 0 (``Example.untrained``) is not.
- the chat template is the tokenizer's unless the spec names one (``CHAT_TEMPLATES``) or gives a Jinja string
  (``with_chat_template``).

``labels[0]`` is always ``IGNORE_INDEX``: nothing in the example precedes its first token, and in a packed
row the token before it belongs to another example, which must not be trained to predict it.

Examples longer than ``seq_len`` are cut to their first ``seq_len`` tokens and counted in
``TokenizedDataset.num_truncated``; an example left with no target (a prompt that fills seq_len) is dropped
and counted in ``num_dropped``. Both are logged.
"""

from __future__ import annotations

import logging
import re
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from horizon_ray.data.formats import Example
from horizon_ray.errors import BadInput

log = logging.getLogger(__name__)

IGNORE_INDEX = -100

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# data.chat_template names; each renders "add_generation_prompt" as the start of an assistant turn
CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}"
    ),
    "llama3": (
        "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
        "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}


@dataclass
class TokenizedExample:
    """One example as token ids; ``labels`` has the same length as ``input_ids``.

    Both are stored as ``array("i")`` (4 bytes a token instead of ~36 for a list of Python ints): the
    dataset lives in the same host RAM the planner budgets for the model. Lists are converted on
    construction; compare with ``list(example.input_ids)``.
    """

    input_ids: array  # token ids, int32
    labels: array  # input_ids where trained, IGNORE_INDEX elsewhere; labels[0] is always ignored
    source: str = ""  # "file:line" of the example

    def __post_init__(self) -> None:
        if not isinstance(self.input_ids, array):
            self.input_ids = array("i", self.input_ids)
        if not isinstance(self.labels, array):
            self.labels = array("i", self.labels)
        assert len(self.input_ids) == len(self.labels), "labels must align with input_ids"

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class TokenizedDataset:
    """A tokenized split, every example at most ``seq_len`` tokens with at least one target."""

    examples: list[TokenizedExample]
    seq_len: int  # the length examples were truncated to
    pad_id: (
        int  # id written into padding (always with label IGNORE_INDEX, so its value is irrelevant to loss)
    )
    num_truncated: int = 0  # examples longer than seq_len, cut to seq_len (dropped ones included)
    num_dropped: int = 0  # examples left with no target after truncation, not in ``examples``

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def num_tokens(self) -> int:
        """Non-padding tokens of the split."""
        return sum(len(e) for e in self.examples)

    @property
    def num_label_tokens(self) -> int:
        """Tokens that are targets of the loss."""
        return sum(
            int((np.frombuffer(e.labels, dtype=np.int32) != IGNORE_INDEX).sum()) for e in self.examples
        )


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in a local folder (a model dir or a tokenizer dir); never downloads."""
    from transformers import AutoTokenizer

    p = Path(path)
    if not p.is_dir():
        raise BadInput(
            f"tokenizer path {p} is not a folder; point it at the model's (or tokenizer's) folder"
        )
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise BadInput(
            f"cannot load a tokenizer from {p} ({exc}); the folder needs tokenizer.json or the tokenizer's "
            "files as written by save_pretrained"
        ) from exc


def with_chat_template(tokenizer: Any, template: str | None) -> Any:
    """`tokenizer` rendering chats with `template`: a name of CHAT_TEMPLATES or a Jinja string (None: its own)."""
    if template is None:
        return tokenizer
    if template in CHAT_TEMPLATES:
        template = CHAT_TEMPLATES[template]
    elif "{{" not in template and "{%" not in template:
        raise BadInput(f"data.chat_template {template!r} is neither a known template ({', '.join(CHAT_TEMPLATES)}) "
                       "nor a Jinja template ({% for message in messages %}...); name one or give the Jinja text",
                       field="data.chat_template")
    tokenizer.chat_template = template
    return tokenizer


def _ids(encoded: Any) -> list[int]:
    """input_ids from apply_chat_template / __call__ output (a list in transformers 4, a dict in 5)."""
    if isinstance(encoded, list):
        return list(encoded)
    return list(encoded["input_ids"])


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def _chat_mask_from_generation_tags(
    tokenizer: Any, messages: list[dict[str, str]], untrained: tuple[int, ...] = ()
) -> tuple[list[int], list[bool]] | None:
    """ids and mask from the template's {% generation %} blocks; None when the turns of weight 0 cannot be told
    apart in it (a block per assistant turn, each a run of the mask, is what it takes)."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = list(out["input_ids"])
    mask = [bool(m) for m in out["assistant_masks"]]
    if untrained:
        runs = _runs(mask)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(runs) != len(turns):
            return None
        for turn, (start, end) in zip(turns, runs, strict=True):
            if turn in untrained:
                mask[start:end] = [False] * (end - start)
    return ids, mask


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    """The (start, end) of every run of True."""
    runs, start = [], None
    for i, m in enumerate([*mask, False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _chat_mask_from_prefixes(
    tokenizer: Any, messages: list[dict[str, str]], source: str, untrained: tuple[int, ...] = ()
) -> tuple[list[int], list[bool]]:
    if not getattr(tokenizer, "is_fast", False):
        raise BadInput(
            f"{source}: the tokenizer is not a fast tokenizer and its chat template has no "
            "{% generation %} markers, so the assistant tokens cannot be located; use the model's "
            "tokenizer.json (fast tokenizer) or add {% generation %} around assistant content in the template"
        )
    text = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i in untrained:
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1])
        if not (through.startswith(before) and text.startswith(through)):
            raise BadInput(
                f"{source}: the chat template renders earlier turns differently once later turns are added "
                f"(assistant turn {i}), so the assistant tokens cannot be located by prefix; add "
                "{% generation %} markers to the template or use a template whose rendering is prefix-stable"
            )
        # The template's own whitespace after the end-of-turn token (e.g. "<|im_end|>\n") is not a target.
        spans.append((len(before), len(through.rstrip())))
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    # A token is a target when it holds a character of an assistant span (HF's assistant_masks rule): a token
    # that merges the prompt's trailing space with the answer's first word (" Hello") is the answer's start.
    mask = [any(start < e and end > s for s, e in spans) for start, end in enc["offset_mapping"]]
    return ids, mask


def _assistant_mask(tokenizer: Any, messages: list[dict[str, str]], source: str,
                    untrained: tuple[int, ...] = ()) -> tuple[list[int], list[bool]]:
    """ids and the mask of the assistant turns not in `untrained`, by the template's tags or by prefixes."""
    template = tokenizer.chat_template
    found = None
    if isinstance(template, str) and _GENERATION_TAG.search(template):
        found = _chat_mask_from_generation_tags(tokenizer, messages, untrained)
    return found or _chat_mask_from_prefixes(tokenizer, messages, source, untrained)


def tokenize_example(example: Example, tokenizer: Any, train_on_inputs: bool = False) -> TokenizedExample:
    """Token ids and labels of one example, not truncated; `train_on_inputs`: a chat's prompts are targets too."""
    if example.text is not None:
        ids = _ids(tokenizer(example.text, add_special_tokens=True))
        eos = tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        labels = list(ids)
    else:
        assert example.messages is not None
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise BadInput(
                f"{example.source}: the tokenizer has no chat_template, which chat and alpaca data need; use "
                "the model's instruct tokenizer, set tokenizer.chat_template, or use the text format"
            )
        ids, mask = _assistant_mask(tokenizer, example.messages, example.source, example.untrained)
        if train_on_inputs:
            # every token a target but those of the assistant turns of weight 0: in the mask of every turn, not
            # in the weighted one
            every = (_assistant_mask(tokenizer, example.messages, example.source)[1] if example.untrained
                     else [False] * len(ids))
            mask = [not (turn and not kept) for turn, kept in zip(every, mask, strict=True)]
        labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask, strict=True)]
    if labels:
        labels[0] = IGNORE_INDEX
    return TokenizedExample(array("i", ids), array("i", labels), example.source)


def tokenize_examples(examples: list[Example], tokenizer: Any, seq_len: int,
                      train_on_inputs: bool = False) -> TokenizedDataset:
    """Tokenize, truncate to ``seq_len`` and count; refuses a result with no usable example."""
    if seq_len < 2:
        raise BadInput(f"seq_len={seq_len} is too short to train anything; use at least 2 (typically 512+)")
    out: list[TokenizedExample] = []
    truncated = dropped = 0
    for example in examples:
        te = tokenize_example(example, tokenizer, train_on_inputs)
        if len(te.input_ids) > seq_len:
            truncated += 1
            te = TokenizedExample(te.input_ids[:seq_len], te.labels[:seq_len], te.source)
        if all(t == IGNORE_INDEX for t in te.labels):
            dropped += 1
            continue
        out.append(te)
    if truncated or dropped:
        log.warning(
            "%d of %d examples longer than seq_len=%d were truncated; %d dropped (no target token left)",
            truncated,
            len(examples),
            seq_len,
            dropped,
        )
    if not out:
        raise BadInput(
            f"none of the {len(examples)} examples has a target token within seq_len={seq_len} "
            f"({dropped} dropped after truncation); raise seq_len or check the data"
        )
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return TokenizedDataset(out, seq_len, int(pad), truncated, dropped)
