"""A small Hugging Face model directory made offline, for tests and benchmarks.

``save_pretrained`` of a random-init Qwen3 causal LM with a real BPE tokenizer: Mistral's
32,000-piece SentencePiece BPE model, which the ``mistral-common`` pip package ships as a data
file (found with ``importlib`` without importing the package), converted to a fast tokenizer,
plus Qwen's chat specials (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``)
and a Qwen-style chat template with tools. Nothing is downloaded. The same loaders read a real
checkpoint such as Qwen3-0.6B: only the directory differs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from robustrl.errors import ConfigError

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
            "<tool_response>", "</tool_response>")

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system{{ '\\n' }}Tools:"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>{{ '\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}{{ message.content }}"
    "{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ message.role }}{{ '\\n' }}{{ message.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}{% endif %}"
    "{% endif %}"
)
"""Qwen's layout, shortened: the tool schemas in a system turn, tool results as a user turn in
``<tool_response>``, Qwen3's ``enable_thinking`` switch (False: an empty think block opens the turn). Newlines are jinja expressions so the text does not depend on the whitespace
options (``trim_blocks`` eats a newline written right after a tag)."""


def bpe_model_file() -> Path:
    """The SentencePiece BPE model shipped inside the ``mistral-common`` package.

    Raises:
        ConfigError: the package is not installed (``pip install --no-deps mistral-common``).
    """
    spec = importlib.util.find_spec("mistral_common")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "tokenizer.model.v1"
        if path.is_file():
            return path
    raise ConfigError("no BPE tokenizer model found: install mistral-common (its data/tokenizer.model.v1)",
                      field="tokenizer")


def build_bpe_tokenizer() -> object:
    """A ``PreTrainedTokenizerFast`` over the shipped BPE model with the chat specials and template."""
    from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor

    parts = SentencePieceExtractor(str(bpe_model_file())).extract(BPE)
    bpe = BPE(vocab=parts["vocab"], merges=parts["merges"], unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": [s for s in SPECIALS if s not in ("<|endoftext|>",
                                                                                            "<|im_end|>")]})
    fast.add_special_tokens({"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_hf_model(directory: str | Path, *, hidden_size: int = 128, num_layers: int = 2, num_heads: int = 2,
                       num_kv_heads: int = 1, intermediate_size: int = 256, max_positions: int = 512,
                       seed: int = 0, tokenizer_from: str | Path | None = None, pad_vocab: int = 0,
                       tied: bool = False) -> Path:
    """Write a random-init Qwen3 causal LM with the BPE tokenizer into ``directory`` (float32,
    untied head; head_dim 64, which vLLM's CPU attention supports). Returns the directory.

    ``tokenizer_from``: a directory holding that tokenizer already saved (a machine without
    ``mistral-common``, e.g. a lent GPU machine, reuses one made here) instead of building it.
    ``pad_vocab``: embedding and head rows past the tokenizer's ids, as real models have them
    (Qwen3: 151936 rows for 151669 ids); no id the tokenizer has ever names them. ``tied``: the
    LM head shares the input embedding, as Qwen3-0.6B's does."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from else build_bpe_tokenizer()
    vocab = len(tok) + pad_vocab  # type: ignore[arg-type]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                      head_dim=hidden_size // num_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=tied, pad_token_id=tok.pad_token_id,  # type: ignore[attr-defined]
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,  # type: ignore[attr-defined]
                      use_cache=True, torch_dtype="float32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))  # type: ignore[attr-defined]
    return directory
