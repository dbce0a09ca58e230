"""The reference policy: a tiny Hugging Face causal LM the trainer trains and the reference engine serves.

The trainer (``workers/trainer``) takes optimizer steps on it; the reference inference engine
(``workers/inference``) generates with it and loads new weights from disk. Both sides import this
module, so the weights a trainer writes are exactly what an engine loads.

**The model** is a ``LlamaForCausalLM`` built from a config in code (:func:`model_config`: one
layer, one attention head of 64 dimensions, rotary positions, untied head), never downloaded. Its
vocabulary is the reference task's characters: ``a``-``z`` are ids 0-25 and a space is 26 (every
other character reads as a space, upper case as lower case). Weights are initialised from
``seed`` alone, without touching the process's random state.

**The tokenizer** is built offline from that vocabulary (:func:`build_tokenizer`: a ``tokenizers``
word-level model over single characters, wrapped as a ``PreTrainedTokenizerFast``) and gives the
ids :func:`encode` gives.

**A weights directory** (:func:`save_weights`) is what ``transformers``'
``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained`` and SGLang's
``update_weights_from_disk`` load:

- ``config.json``, ``generation_config.json``, ``model.safetensors`` — ``save_pretrained``;
- ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` — the tokenizer;
- ``weights.json`` — ``{"version": <str>, "sha256": <hex digest of model.safetensors>, "vocab": <int>,
  "dim": <int>}``, written last.

Each file is written to a temporary name and renamed into place (fsync'd), ``weights.json``
last, so a fresh directory is readable once ``weights.json`` exists. A reader that races a rewrite
of the same directory may see new weights with the old digest: it gets :class:`WeightsError`, never
weights that do not match their version. :func:`load_weights` checks the digest, the config and
the tensors' names and shapes, and raises :class:`WeightsError` naming the file and the rule.

Generation (:meth:`Policy.generate`) is greedy over the whole prefix, so the same weights and
prompt always give the same tokens, and ``from_pretrained(...).generate(do_sample=False)`` gives
them too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .files import fsync_directory, write_atomically

#: Tokens of the reference task: the letters ``a``-``z`` and a space (id 26).
VOCAB = 27
#: The hidden size (one attention head of this many dimensions).
DIM = 64
MODEL_FILE = "model.safetensors"
META_FILE = "weights.json"
#: What ``save_pretrained`` of the model and the tokenizer write (besides :data:`META_FILE`).
HF_FILES = ("config.json", "generation_config.json", MODEL_FILE, "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json")
#: The longest sequence the rotary positions are configured for.
MAX_POSITIONS = 4096
SPACE = 26


class WeightsError(ValueError):
    """A weights directory that cannot be loaded (missing file, digest, config or shape mismatch)."""


def model_config(vocab: int = VOCAB, dim: int = DIM) -> LlamaConfig:
    """The reference model's config: a causal LM small enough to train a step in milliseconds on a CPU."""
    return LlamaConfig(  # type: ignore[no-untyped-call]  # transformers' constructors are untyped
        vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=MAX_POSITIONS,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       attn_implementation="eager", torch_dtype="float32")


def build_tokenizer(vocab: int = VOCAB) -> PreTrainedTokenizerFast:
    """The character tokenizer of the reference task, built offline (see the module docs)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    chars = {chr(97 + i): i for i in range(26)}
    chars[" "] = SPACE
    words = {c: i for c, i in chars.items() if i < vocab}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token=" "))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, unk_token=" ", clean_up_tokenization_spaces=False)


class Policy(nn.Module):
    """The reference causal LM (see the module docs); ``lm`` is the ``LlamaForCausalLM`` itself."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, seed: int = 0) -> None:
        super().__init__()
        self.vocab = vocab
        self.dim = dim
        # Seeded init that leaves the process's random state as it was (a trainer rank may share it):
        # only the CPU generator is seeded (torch.manual_seed would reseed CUDA's too), and restored.
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            self.lm = LlamaForCausalLM(model_config(vocab, dim))  # type: ignore[no-untyped-call]

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Next-token logits at every position, each given the tokens up to it: ``(L,)`` gives
        ``(L, vocab)``, ``(B, L)`` gives ``(B, L, vocab)``."""
        single = tokens.dim() == 1
        batch = tokens.unsqueeze(0) if single else tokens
        mask = None if attention_mask is None else (attention_mask.unsqueeze(0) if single else attention_mask)
        logits: torch.Tensor = self.lm(input_ids=batch, attention_mask=mask, use_cache=False).logits
        return logits[0] if single else logits

    @torch.no_grad()
    def next_logits(self, tokens: list[int]) -> torch.Tensor:
        """The logits of the token after ``tokens`` (which must hold at least one)."""
        device = next(self.parameters()).device
        logits: torch.Tensor = self(torch.tensor(tokens, dtype=torch.long, device=device))[-1]
        return logits.float().cpu()

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt`` (which must hold at least one token)."""
        if not prompt:
            raise ValueError("prompt: must hold at least one token")
        seq, out = list(prompt), []
        for _ in range(max_new_tokens):
            token = int(self.next_logits(seq).argmax())
            seq.append(token)
            out.append(token)
        return out


def encode(text: str) -> list[int]:
    """Text to token ids: ``a``-``z`` are 0-25, every other character is a space (26)."""
    return [ord(c) - 97 if "a" <= c <= "z" else SPACE for c in text.lower()]


def decode(tokens: list[int]) -> str:
    return "".join(chr(97 + t) if 0 <= t < 26 else " " for t in tokens)


def save_weights(model: Policy, directory: str | os.PathLike[str], version: str) -> str:
    """Write ``model`` as ``version`` into ``directory`` (see the module docs); returns the SHA-256 of
    ``model.safetensors``."""
    if not version:
        raise ValueError("version: must be a non-empty string")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        model.lm.save_pretrained(staging, safe_serialization=True)
        build_tokenizer(model.vocab).save_pretrained(staging)
        digest = hashlib.sha256((staging / MODEL_FILE).read_bytes()).hexdigest()
        for name in sorted(p.name for p in staging.iterdir()):
            # Each file whole or not at all; the digest below is what binds them to the version.
            write_atomically(target / name, (staging / name).read_bytes())
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    meta = {"version": version, "sha256": digest, "vocab": model.vocab, "dim": model.dim}
    write_atomically(target / META_FILE, json.dumps(meta, sort_keys=True).encode())
    fsync_directory(target)
    return digest


def load_weights(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The :class:`Policy` state dict and the metadata of a weights directory, verified (see the
    module docs)."""
    source = Path(directory)
    try:
        meta = json.loads((source / META_FILE).read_text())
        data = (source / MODEL_FILE).read_bytes()
        config = json.loads((source / "config.json").read_text())
    except FileNotFoundError as exc:
        raise WeightsError(f"{exc.filename}: missing from the weights directory") from None
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{source}: unreadable weights directory ({exc})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("version"), str) or not meta["version"]:
        raise WeightsError(f"{source / META_FILE}: 'version' must be a non-empty string")
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta.get("sha256"):
        raise WeightsError(f"{source / MODEL_FILE}: sha256 {digest[:12]}… does not match "
                           f"{str(meta.get('sha256'))[:12]}… in {META_FILE}")
    vocab, dim = meta.get("vocab", VOCAB), meta.get("dim", DIM)
    for name, value in (("vocab", vocab), ("dim", dim)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise WeightsError(f"{source / META_FILE}: {name!r} must be an integer >= 1, got {value!r}")
    if not isinstance(config, dict) or (config.get("vocab_size"), config.get("hidden_size")) != (vocab, dim):
        raise WeightsError(f"{source / 'config.json'}: vocab_size/hidden_size do not match {META_FILE}'s "
                           f"vocab {vocab} / dim {dim}")
    try:
        # From the bytes the digest covered, not a second read a rewrite could change meanwhile.
        tensors = load_safetensors(data)
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise WeightsError(f"{source / MODEL_FILE}: not a safetensors file ({exc})") from None
    state = {f"lm.{k}": v for k, v in tensors.items()}
    with torch.device("meta"):  # shapes only: no memory, no initialisation
        expected = Policy(vocab, dim).state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise WeightsError(f"{source / MODEL_FILE}: tensors do not match the reference policy "
                           f"(vocab {vocab}, dim {dim})")
    return state, meta


__all__ = ["DIM", "HF_FILES", "META_FILE", "MODEL_FILE", "VOCAB", "Policy", "WeightsError", "build_tokenizer",
           "decode", "encode", "load_weights", "model_config", "save_weights"]
