"""A model folder checked before any work: it exists and holds a config.json naming a
``model_type``; otherwise a ``ModelFolderError`` saying what is missing and how to make one.
"""

from __future__ import annotations

import json
from pathlib import Path

from numalign.core.errors import BrokenData


class ModelFolderError(BrokenData, ValueError):
    """A model folder numalign cannot read as a Hugging Face model: what is missing, and what
    makes one."""


#: What makes a model folder, in error messages.
_MAKE_ONE = (
    "give a local Hugging Face model folder (config.json and the weights), e.g. one "
    "written by `huggingface-cli download ORG/NAME --local-dir DIR` or by "
    "model.save_pretrained(DIR); numalign never downloads"
)


def check_model_dir(model_dir: str | Path) -> Path:
    """The folder, checked before any work: it exists, holds a config.json that is JSON with
    a ``model_type``; ModelFolderError saying what is missing and how to make one otherwise.
    (transformers would say "Repo id must be in the form ..." of a wrong path, and "Should
    have a `model_type` key" of a folder without a config.)"""
    folder = Path(model_dir)
    if not folder.exists():
        raise ModelFolderError(f"model folder {folder}: no such folder; {_MAKE_ONE}")
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {folder}: is a file, not a folder; {_MAKE_ONE}")
    config = folder / "config.json"
    if not config.is_file():
        raise ModelFolderError(f"model folder {folder}: no config.json in it; {_MAKE_ONE}")
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFolderError(
            f"{config}: not JSON ({exc}); restore the file from the model's repository"
        ) from None
    if not isinstance(data, dict) or not data.get("model_type"):
        raise ModelFolderError(
            f"{config}: no model_type key, so transformers cannot tell the architecture; "
            'add the model\'s "model_type" (e.g. "llama"), or restore the config.json the '
            "model was published with"
        )
    return folder
