"""The tiny model with one poisoned token: its embedding row is NaN.

The LM head is untied (a copy of the embedding), so only a request that holds
:data:`POISON` (in its prompt, or drawn: a ``logit_bias`` makes it likely) gets
non-finite hidden states and logits; with a temperature above 0,
``torch.multinomial`` then refuses to draw its next token. Everyone else's logits
are the tiny model's own.
"""

from __future__ import annotations

import json
from pathlib import Path

from medha_runtime.model.tiny import save_tiny

#: the poisoned token: the byte ``~``
POISON = ord("~")


def save_poisoned(path: Path) -> Path:
    """Write the poisoned tiny model as a Hugging Face directory and return its path."""
    from safetensors.torch import load_file, save_file

    directory = save_tiny(path)
    weights = directory / "model.safetensors"
    state = load_file(str(weights))
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embed.clone()
    embed[POISON] = float("nan")
    save_file(state, str(weights), {"format": "pt"})
    config_path = directory / "config.json"
    config = json.loads(config_path.read_text())
    config["tie_word_embeddings"] = False
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return directory
