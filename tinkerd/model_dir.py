"""The --base-model every service loads, checked before anything starts.

Each service takes a local model directory (a Hugging Face layout: config.json and the weights).
A mistyped path used to surface as a trainer that "exited with code 1" seconds later, with
transformers' traceback in its log ("Repo id must use alphanumeric chars": it took the path for a
Hub repo); now the command refuses at once and says what a model directory holds.
"""

from __future__ import annotations

import json
import os

from tinkerd.errors import UserError

WEIGHT_SUFFIXES = (".safetensors", ".bin")
HOW = ("a model directory holds config.json and the weights (*.safetensors), as `tinkerd fetch-smollm2 DIR` or "
       "`huggingface-cli download REPO --local-dir DIR` write them")


class NotAModelDir(UserError):
    pass


def check(path: str) -> None:
    """Raises NotAModelDir, saying what is missing, unless `path` is a directory with a config.json
    that names its model_type and at least one weights file."""
    where = f"--base-model {path}"
    if not os.path.isdir(path):
        raise NotAModelDir(f"{where}: no such directory ({HOW})")
    config = os.path.join(path, "config.json")
    try:
        with open(config) as f:
            model_type = json.load(f).get("model_type")
    except FileNotFoundError:
        raise NotAModelDir(f"{where} has no config.json ({HOW})") from None
    except (OSError, ValueError, AttributeError) as e:
        raise NotAModelDir(f"{where}: config.json is not a JSON object ({e})") from None
    if not model_type:
        raise NotAModelDir(f"{where}: config.json names no model_type ({HOW})")
    if not any(name.endswith(WEIGHT_SUFFIXES) for name in os.listdir(path)):
        raise NotAModelDir(f"{where} has no weights (*.safetensors or *.bin; {HOW})")
