"""A Hugging Face model directory (config.json beside model.safetensors or its shards), read without torch:
what gpt_hf and llama_hf share. The config is read before the weights, so that an unsupported config fails
before gigabytes are read."""

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from purejax import safetensors


def read_config(directory: str | os.PathLike) -> tuple[dict[str, Any], str]:
    """(config.json's contents, its path for error messages) of a Hugging Face model directory."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: a Hugging Face model directory has a config.json")
    return json.loads(config_file.read_text()), str(config_file)


def read_weights(directory: str | os.PathLike) -> dict[str, np.ndarray]:
    """The tensors of a Hugging Face directory's model.safetensors, or of the shards its index lists; a
    directory with only a pickled pytorch_model.bin gets an error saying how to convert it (never unpickled)."""
    convert = "transformers (model.save_pretrained(dir, safe_serialization=True))"
    return safetensors.load_pretrained(
        directory, "model.safetensors", pickle_file="pytorch_model.bin", how_to_convert=convert
    )
