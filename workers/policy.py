"""The reference policy: the one small torch model the trainer trains and the reference engine serves.

The trainer (``workers/trainer``) takes optimizer steps on it; the reference inference engine
(``workers/inference``) generates with it and loads new weights from disk. Both sides import
this module, so the weights a trainer writes are exactly what an engine loads.

Weights on disk (a *weights directory*), written by :func:`save_weights`:

- ``model.pt`` — the model's ``state_dict`` saved with ``torch.save``;
- ``weights.json`` — ``{"version": <str>, "sha256": <hex digest of model.pt>, "vocab": <int>,
  "dim": <int>}``, written after ``model.pt``.

Both files are written atomically (:func:`workers.files.write_atomically`), the digest last,
so a fresh directory is readable once ``weights.json`` exists. A reader that races a
rewrite of the same directory may see the new ``model.pt`` with the old digest: it gets
:class:`WeightsError`, never weights that do not match their version. :func:`load_weights`
checks the digest and the shape and raises :class:`WeightsError` naming the file and the
rule broken.

The model maps a token to a distribution over the next token (an embedding and a linear head
over a small vocabulary). Generation is greedy, so the same weights and prompt always give
the same tokens.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .files import write_atomically

#: Tokens of the reference task: the letters ``a``-``z`` and a space (id 26).
VOCAB = 27
DIM = 16
MODEL_FILE = "model.pt"
META_FILE = "weights.json"


class WeightsError(ValueError):
    """A weights directory that cannot be loaded (missing file, digest or shape mismatch)."""


class Policy(nn.Module):
    """Next-token logits from the previous token: ``embed`` then a linear ``head``."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.dim = dim
        self.embed = nn.Embedding(vocab, dim)
        self.head = nn.Linear(dim, vocab)
        with torch.no_grad():  # seeded init, independent of the global RNG
            self.embed.weight.copy_(torch.randn(vocab, dim, generator=generator) * 0.5)
            self.head.weight.copy_(torch.randn(vocab, dim, generator=generator) * 0.5)
            self.head.bias.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of shape ``tokens.shape + (vocab,)``."""
        out: torch.Tensor = self.head(self.embed(tokens))
        return out

    @torch.no_grad()
    def generate(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of ``prompt`` (which must hold at least one token)."""
        if not prompt:
            raise ValueError("prompt: must hold at least one token")
        out: list[int] = []
        last = prompt[-1]
        for _ in range(max_new_tokens):
            last = int(self(torch.tensor([last])).argmax(-1).item())
            out.append(last)
        return out


def encode(text: str) -> list[int]:
    """Text to token ids: ``a``-``z`` are 0-25, every other character is a space (26)."""
    return [ord(c) - 97 if "a" <= c <= "z" else 26 for c in text.lower()]


def decode(tokens: list[int]) -> str:
    return "".join(chr(97 + t) if 0 <= t < 26 else " " for t in tokens)


def save_weights(model: Policy, directory: str | os.PathLike[str], version: str) -> str:
    """Write ``model``'s weights as ``version`` into ``directory``; returns the SHA-256 of ``model.pt``."""
    if not version:
        raise ValueError("version: must be a non-empty string")
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    data = buf.getvalue()
    digest = hashlib.sha256(data).hexdigest()
    write_atomically(target / MODEL_FILE, data)
    meta = {"version": version, "sha256": digest, "vocab": model.vocab, "dim": model.dim}
    write_atomically(target / META_FILE, json.dumps(meta, sort_keys=True).encode())
    return digest


def load_weights(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dict and the metadata of a weights directory, verified (see the module docs)."""
    source = Path(directory)
    try:
        meta = json.loads((source / META_FILE).read_text())
        data = (source / MODEL_FILE).read_bytes()
    except FileNotFoundError as exc:
        raise WeightsError(f"{exc.filename}: missing from the weights directory") from None
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{source / META_FILE}: unreadable ({exc})") from None
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
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    expected = Policy(vocab, dim).state_dict()
    if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
        raise WeightsError(f"{source / MODEL_FILE}: tensors do not match the reference policy "
                           f"(vocab {meta.get('vocab')}, dim {meta.get('dim')})")
    return state, meta


__all__ = ["DIM", "META_FILE", "MODEL_FILE", "VOCAB", "Policy", "WeightsError", "decode", "encode",
           "load_weights", "save_weights"]
