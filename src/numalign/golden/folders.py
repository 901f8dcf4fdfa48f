"""What numalign may write over, and how it marks what it wrote: the folders of a sets root.

A capture writes only into a folder that does not exist, an empty folder, or a golden set of
the same model (by its manifest); a set of another model is replaced only when asked
(``force``) and kept under ``<sets>/.versions/NAME/STAMP/``, as the nightly keeps it. Anything
else at the target (documents, a model folder, a folder of sets) is a ``CaptureTargetError``
naming what is there: numalign never deletes what it did not write.

numalign's own transient folders (a capture's temporary folder, the ``.previous`` folder of a
replacement) carry a marker file, ``.numalign-folder``: JSON with the kind, the folder name
the marker applies to, and the writer's host and process id. Discovery skips a folder whose
marker names the folder's own name, so a killed capture's leftovers are never replayed, while
a folder renamed by hand (``mv X.previous X`` after an interrupted replacement) is a set
again. Only marked folders, and only the files a set consists of, are ever deleted.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

from numalign.golden.manifest import MANIFEST, GoldenSetError

__all__ = [
    "MARKER", "VERSIONS", "CaptureTargetError", "check_target", "clear_temporary",
    "keep_version", "mark", "marked", "remove_abandoned", "remove_written", "temporary_folder",
]  # fmt: skip

#: The marker file of numalign's transient folders.
MARKER = ".numalign-folder"
#: Where replaced sets are kept, under the sets root (the nightly's layout).
VERSIONS = ".versions"
#: What a golden set folder holds besides its shards (``tensors-*.safetensors``).
_SET_FILES = (MANIFEST, MARKER)


class CaptureTargetError(GoldenSetError):
    """A capture's --out is something numalign must not replace."""


def mark(folder: Path, kind: str, *, name: str | None = None) -> None:
    """Writes ``folder``'s marker: ``kind`` (``capture`` or ``previous``) applies while the
    folder is named ``name`` (default: its name now)."""
    data = {
        "kind": kind,
        "name": name or folder.name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }
    (folder / MARKER).write_text(json.dumps(data), encoding="utf-8")


def marked(folder: Path) -> dict[str, object] | None:
    """The marker of ``folder`` when it applies to the folder under its current name."""
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("name") != folder.name:
        return None
    return data


def temporary_folder(out: Path) -> Path:
    """A new, marked temporary folder beside ``out`` (a random suffix: process ids repeat
    across containers sharing a filesystem)."""
    tmp = out.parent / f".{out.name}.capture-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    mark(tmp, "capture")
    return tmp


def remove_written(folder: Path) -> bool:
    """Deletes a golden set's own files in ``folder`` (manifest, shards, marker, temporary
    manifests) and the folder when nothing else is left; True when it is gone. Anything
    numalign did not write stays."""
    if not folder.is_dir():
        return not folder.exists()
    for path in folder.iterdir():
        ours = path.name in _SET_FILES or (
            path.name.startswith("tensors-") and path.suffix == ".safetensors"
        )
        ours = ours or (path.name.startswith(f".{MANIFEST}.") and path.suffix == ".tmp")
        if ours and path.is_file() and not path.is_symlink():
            path.unlink()
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def remove_abandoned(folder: Path) -> list[Path]:
    """Removes the marked temporary folders of captures on this host whose process died (a
    SIGKILL cannot clean up after itself); a live capture's folder, another host's and any
    unmarked folder are left alone."""
    removed = []
    for tmp in folder.glob(".*.capture-*"):
        data = marked(tmp)
        if not data or data.get("kind") != "capture" or data.get("host") != socket.gethostname():
            continue
        pid = data.get("pid")
        if not isinstance(pid, int):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            if remove_written(tmp):
                removed.append(tmp)
        except PermissionError:  # alive, another user's
            pass
    return removed


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
        from dataclasses import replace

        from numalign.golden.store import GoldenSet, write_manifest

        manifest = GoldenSet.open(keep).manifest
        manifest.model = replace(manifest.model, path=str(model_dir))
        write_manifest(keep, manifest)
    return keep


def _model_dir(folder: Path) -> Path | None:
    """The model folder of the set at ``folder``, None where its manifest is unreadable."""
    from numalign.golden.store import GoldenSet

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
        if p.name not in _SET_FILES and not p.name.startswith(("tensors-", f".{MANIFEST}."))
    )
    if foreign:
        raise CaptureTargetError(
            f"--out {out}: is a golden set that also holds files numalign did not write "
            f"({', '.join(foreign[:5])}); move them out of it, or give another --out"
        )
    from numalign.golden.store import GoldenSet

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


def clear_temporary(tmp: Path) -> None:
    """Deletes a capture's temporary folder, only when it carries its marker."""
    data = marked(tmp)
    if data and data.get("kind") == "capture":
        remove_written(tmp)
