"""What a capture records and how it runs its reference: ``CaptureSpec``, the options of
``golden.capture.capture`` (and of ``replay.ensemble.capture_calibrated``) in one frozen
object, every default the capture's own. ``dataclasses.replace(spec, long=0)`` varies one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from numalign.core.statistics import DEFAULT_WIDTH
from numalign.golden.decode import DEFAULT_DECODE_STEPS
from numalign.golden.requests import FAR_LENGTH
from numalign.golden.shards import DEFAULT_SHARD_BYTES

if TYPE_CHECKING:
    from numalign.golden.reference import Placement
    from numalign.golden.store import GoldenSet

#: Greedy tokens a capture records per generating request, re-running the whole sequence.
DEFAULT_CONTINUATION = 8


@dataclass(frozen=True)
class CaptureSpec:
    """The options of one capture. ``check`` refuses bad counts, a missing image and a
    reference dtype other than float32 or float64 before any model loads; the sizes of the
    long and far-position requests are checked against the model once its config is read."""

    points: Sequence[str] | None = None
    """Module name patterns (fnmatch) to capture; None or empty: the default points
    (``capture_points.default_points``), with each activation probed as a point of its own
    (``golden.probes``)."""
    prompts: Sequence[str] | None = None
    """The text requests' prompts; None or empty: ``requests.DEFAULT_PROMPTS``."""
    image: str | None = None
    """An image file for image-text models' image request; None: a built-in image."""
    reference_dtype: str = "float32"
    """The dtype the reference runs in: ``float32`` or ``float64``."""
    continuation: int = DEFAULT_CONTINUATION
    """Greedy tokens recorded per generating request, without a cache (0: none)."""
    decode_steps: int = DEFAULT_DECODE_STEPS
    """Cached decode steps recorded per generating request (0: none; encoders: none)."""
    long: int | None = None
    """The long requests' length in tokens: None, past every length boundary of a decoder
    (``requests.long_length``; encoders get none); 0, none. Past the model's positions or
    the memory: refused before the model loads (``long_bound.check_long_request``)."""
    far: int = FAR_LENGTH
    """Tokens per row of the far-position request (0: none), its rows a quarter, half and all
    the way into ``max_position`` (``requests.far_request``)."""
    max_position: int | None = None
    """The position range the far-position request spans, at least 1; None: the config's."""
    attn_implementation: str | None = None
    """The reference's attention implementation; None: eager, the reference implementation,
    whose explicit 4D masks every other implementation accepts when a point is replayed
    alone."""
    trust_remote_code: bool = False
    """Run the model folder's own Python code (False: transformers' classes only)."""
    placement: Placement | None = None
    """Accelerate's device map and disk offload (``reference.Placement``) for a model whose
    weights do not fit in memory; None: loaded whole (or streamed). The set is the same."""
    max_shard_bytes: int = DEFAULT_SHARD_BYTES
    """The size in bytes at which the set's safetensors shards are cut."""
    progress: bool | None = None
    """The capture's progress: True, a bar; False, silent; None, a bar on a terminal and one
    line per step in a log (``progress.progress_mode``)."""
    finish: Callable[[GoldenSet, Callable[[str], None]], None] | None = None
    """Run as ``finish(golden, step)`` on the whole set in its temporary folder before it is
    moved into place (``replay.ensemble.capture_calibrated`` calibrates there); ``step(text)``
    advances the progress bar."""
    finish_steps: int = 0
    """How many progress steps ``finish`` takes."""
    force: bool = False
    """Replace a set of another model at the target, kept under ``<sets>/.versions/``
    (``target.check_target``); False: such a target is refused."""
    probes: bool = True
    """Record each point's probe calls (``golden.probes``); False: none."""
    stream: bool | None = None
    """Stream the reference unit by unit from the checkpoint (``golden.stream``): True or
    False as asked; None, the automatic choice (``capture.resolve_stream``)."""
    full_points: Sequence[str] | None = None
    """Module name patterns (fnmatch) whose points keep their tensors whole; every other
    point keeps its floating outputs (and inputs only it records) as exact statistics and a
    sketch (``core.statistics``; ``statistics_info.KeptWhole``). None: every tensor whole."""
    sketch_width: int = DEFAULT_WIDTH
    """The buckets of each statistics-only tensor's sketch (``core.statistics``): its
    relative L2 estimate is within 3 * sqrt(1 / (2 * width)), 6.6% at the default."""

    def check(self) -> None:
        """The counts are whole numbers of at least 0, the image a file and the reference
        dtype float32 or float64 (ValueError naming the option otherwise), checked before the
        model loads."""
        if self.reference_dtype not in ("float32", "float64"):
            raise ValueError(f"--reference-dtype {self.reference_dtype!r}: float32 or float64")
        counts = (("--continuation", self.continuation), ("--decode-steps", self.decode_steps))
        for option, value in counts:
            if value < 0:
                raise ValueError(f"{option} {value}: a number of tokens, 0 or more (0: none)")
        if self.sketch_width < 1:
            raise ValueError(f"--sketch-width {self.sketch_width}: a number of buckets, 1 or more")
        if self.image is not None and not Path(self.image).is_file():
            raise ValueError(
                f"--image {self.image}: no such file; give an image file (PNG, JPEG, ...)"
            )
