"""How numalign marks the folders it writes in a sets root, and deletes only what it wrote.

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

from numalign.golden.manifest import MANIFEST

__all__ = [
    "MARKER", "SET_FILES", "clear_temporary", "mark", "marked", "remove_abandoned",
    "remove_written", "temporary_folder",
]  # fmt: skip

#: The marker file of numalign's transient folders.
MARKER = ".numalign-folder"
#: What a golden set folder holds besides its shards (``tensors-*.safetensors``).
SET_FILES = (MANIFEST, MARKER)


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
        ours = path.name in SET_FILES or (
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


def clear_temporary(tmp: Path) -> None:
    """Deletes a capture's temporary folder, only when it carries its marker."""
    data = marked(tmp)
    if data and data.get("kind") == "capture":
        remove_written(tmp)
