"""Model fingerprints: sha256 over config.json and the weight files, in name order."""

from __future__ import annotations

import hashlib
from pathlib import Path

#: Files that define a model's numerics: its config and its weights.
_PATTERNS = ("config.json", "*.safetensors", "*.safetensors.index.json")


def model_files(model_dir: Path) -> list[Path]:
    files = {p for pattern in _PATTERNS for p in model_dir.glob(pattern) if p.is_file()}
    return sorted(files, key=lambda p: p.name)


def fingerprint(model_dir: str | Path) -> str:
    """``sha256:<hex>`` over the names and bytes of config.json and the weight files."""
    folder = Path(model_dir)
    files = model_files(folder)
    if not any(p.name == "config.json" for p in files):
        raise FileNotFoundError(
            f"{folder / 'config.json'}: not found; give a Hugging Face model folder "
            "(config.json and safetensors weights, as save_pretrained writes)"
        )
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            while block := fh.read(1 << 20):
                digest.update(block)
    return "sha256:" + digest.hexdigest()
