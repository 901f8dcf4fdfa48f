"""Streamed replay (``--stream``): a model whose weights do not fit on the device, run with
only the weights of the module running on it.

The streaming itself (``load_streamed``, the ``Streamer``, the checkpoint's files) lives in
``golden.stream``, below both the capture, which streams its reference with it
(``numalign capture --stream``), and the replays, which stream the candidate; the replays
import it from here. Its docstring says what loads when and what it costs.
"""

from __future__ import annotations

from numalign.golden.stream import (
    SHARD_INDEX,
    SINGLE_FILE,
    Streamer,
    StreamError,
    StreamUnsupported,
    checkpoint_files,
    load_streamed,
)

__all__ = [
    "SHARD_INDEX",
    "SINGLE_FILE",
    "StreamError",
    "StreamUnsupported",
    "Streamer",
    "checkpoint_files",
    "load_streamed",
]
