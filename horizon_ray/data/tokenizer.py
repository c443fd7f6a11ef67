"""The demo tokenizer: byte-level, no merges, a handful of special tokens and a chat template.

One token per byte is deliberate: the demo tasks (adding, reversing, sorting, copying) are operations on
characters, and a tiny model learns them in a few hundred steps only when every character is its own
token. Any UTF-8 text round-trips exactly, so nothing is ever unknown. Vocabulary: 6 special tokens + 256
bytes = 262 ids.

The files are written by hand rather than through ``save_pretrained`` so that they are byte-identical on
every run and every transformers version, and so that the chat template lives in tokenizer_config.json,
where both transformers 4.x and 5.x read it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
# Ids 0..5 in this order; bytes follow at 6..261.
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, *ROLE_TOKENS.values())
DEMO_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Every turn is "<|role|>content<|eos|>"; the assistant turn (content + eos) is wrapped in
# {% generation %} so that transformers can return the assistant mask itself. eos ends every turn, so
# greedy decoding stops at the end of the answer.
DEMO_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{%- elif message['role'] in ['system', 'user'] -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}{{ eos_token }}"
    "{%- else -%}"
    "{{ raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of the ByteLevel pre-tokenizer."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _build_tokenizer() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for _, char in sorted(_bytes_to_unicode().items()):
        vocab[char] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: with no merges, splitting changes nothing but the round trip.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Plain text gets bos like a causal LM tokenizer; chat rendering adds bos itself and is tokenized
    # with add_special_tokens=False.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, vocab[BOS_TOKEN])]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == DEMO_VOCAB_SIZE
    return tok


def build_demo_tokenizer(out_dir: str | Path) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into ``out_dir``.

    ``transformers.AutoTokenizer.from_pretrained(out_dir)`` loads it offline; ``apply_chat_template``
    works. Returns ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    roles = list(ROLE_TOKENS.values())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": roles,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": DEMO_CHAT_TEMPLATE,
    }
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": roles,
    }
    for name, payload in (("tokenizer_config.json", config), ("special_tokens_map.json", special_map)):
        (out / name).write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
