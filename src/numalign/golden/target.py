"""Where a capture may write: ``check_target`` and ``keep_version``.

A capture writes only into a folder that does not exist, an empty folder, or a golden set of
the same model (by its manifest's model folder); a set of another model is replaced only when
asked (``force``) and kept under ``<sets>/.versions/NAME/STAMP/``, as the nightly keeps it.
Anything else at the target (documents, a model folder, a folder of sets, a set holding files
numalign did not write) is a ``CaptureTargetError`` naming what is there: numalign never
deletes what it did not write.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from numalign.golden.folders import SET_FILES
from numalign.golden.manifest import MANIFEST, GoldenSetError
from numalign.golden.store import GoldenSet, write_manifest

__all__ = ["VERSIONS", "CaptureTargetError", "check_target", "keep_version"]

#: Where replaced sets are kept, under the sets root (the nightly's layout).
VERSIONS = ".versions"


class CaptureTargetError(GoldenSetError):
    """A capture's --out is something numalign must not replace."""


def keep_version(target: Path, stamp: str) -> Path:
    """Moves the set at ``target`` to ``<sets>/.versions/NAME/STAMP`` (a free name: an
    existing version is never overwritten) with its model's path made absolute (a relative
    one is relative to the set's folder); returns where it went."""
    model_dir = _model_dir(target)
    keep = target.parent / VERSIONS / target.name / (stamp.replace(":", "") or "unknown")
    base, n = keep, 1
    while keep.exists():
        n += 1
        keep = base.with_name(f"{base.name}-{n}")
    keep.parent.mkdir(parents=True, exist_ok=True)
    os.replace(target, keep)
    if model_dir is not None:
        manifest = GoldenSet.open(keep).manifest
        manifest.model = replace(manifest.model, path=str(model_dir))
        write_manifest(keep, manifest)
    return keep


def _model_dir(folder: Path) -> Path | None:
    """The model folder of the set at ``folder``, None where its manifest is unreadable."""
    try:
        return GoldenSet.open(folder).model_dir
    except GoldenSetError:
        return None


def check_target(out: Path, model_dir: Path, *, force: bool = False) -> bool:
    """Whether a capture of ``model_dir`` may write ``out``: True when ``out`` holds a set of
    another model that ``force`` lets it replace (the caller keeps it with ``keep_version``),
    False when there is nothing to keep; ``CaptureTargetError`` naming what is there when
    numalign must not touch it."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CaptureTargetError(
            f"--out {out}: is a file or a link, not a golden set folder; give a new folder, "
            "e.g. golden/sets/NAME"
        )
    if not out.exists() or not any(out.iterdir()):
        return False
    if not (out / MANIFEST).is_file():
        raise CaptureTargetError(_not_a_set(out))
    foreign = sorted(
        p.name
        for p in out.iterdir()
        if p.name not in SET_FILES and not p.name.startswith(("tensors-", f".{MANIFEST}."))
    )
    if foreign:
        raise CaptureTargetError(
            f"--out {out}: is a golden set that also holds files numalign did not write "
            f"({', '.join(foreign[:5])}); move them out of it, or give another --out"
        )
    try:
        golden = GoldenSet.open(out)
        theirs, same = golden.model_dir, golden.model_dir == model_dir.resolve()
    except GoldenSetError:
        theirs, same = Path("(an unreadable manifest)"), False
    if same:
        return False
    if not force:
        raise CaptureTargetError(
            f"--out {out}: holds the golden set of another model ({theirs}), not of "
            f"{model_dir}; give another --out, or pass --force to replace it (the old set is "
            f"kept under {out.parent / VERSIONS / out.name}/)"
        )
    return True


def _not_a_set(out: Path) -> str:
    """The error for a non-empty ``out`` without a manifest: what is there."""
    sets = sorted(p.name for p in out.iterdir() if (p / MANIFEST).is_file())
    if sets:
        return (
            f"--out {out}: holds {len(sets)} golden set(s) ({', '.join(sets[:5])}), it is not "
            f"one; give the set's own folder, e.g. --out {out / 'NAME'}"
        )
    if (out / "config.json").is_file():
        return f"--out {out}: is a model folder; give a golden set folder, e.g. golden/sets/NAME"
    names = sorted(p.name for p in out.iterdir())
    return (
        f"--out {out}: is not a golden set and not empty ({len(names)} entries: "
        f"{', '.join(names[:5])}); numalign writes only into a new folder or a golden set of "
        "the same model: give another --out"
    )
