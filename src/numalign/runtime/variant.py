"""The execution variant: what a test ran instead of, or besides, the reference's defaults.

A :class:`Variant` is built once from the session's settings (:meth:`Variant.from_settings`,
or :meth:`Variant.for_operators` for the operator suite, where only the compile variant
applies), keys the model cache (``replay.model.ModelCache``: one model per set and variant),
and is written into every record as structured fields (:meth:`Variant.record_fields`, record
schema 3). Its :attr:`Variant.label` is the string records have always carried in ``swap``
(``rms_norm=fused,attention=sdpa,compile=inductor:max-autotune,tp=2,stream,cache=static``), kept
for readers of older records and for the reports' tables.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from numalign.runtime.compiled import CompileSpec, compile_spec

if TYPE_CHECKING:
    from numalign.session.settings import Settings


@dataclass(frozen=True)
class Variant:
    """How one test runs: the engine that replays the model (None in the operator suite,
    which runs candidates directly), the device (``cpu``, ``cuda:0``; a spec such as ``auto``
    where it is not resolved yet), the dtype, the attention and experts implementations
    asked for (None: the model's own), the kernel swaps (``--swap`` specs, in order), the
    compile variant (None: eager), the tensor-parallel and pipeline ranks (1: one process),
    whether the weights stream from the checkpoint unit by unit (``--stream``,
    ``golden.stream``), the decode's KV cache (None outside decode) and the engine's own
    account of what it ran (vLLM: its version, attention backend and graph mode; None for
    transformers)."""

    engine: str | None = None
    device: str = "auto"
    dtype: str | None = None
    attention: str | None = None
    experts: str | None = None
    swaps: tuple[str, ...] = ()
    compile: CompileSpec | None = None
    tp: int = 1
    pp: int = 1
    #: the layers each pipeline rank holds, ``0-1|2-3`` (``replay.pipeline_split.layout``; None:
    #: not known yet, or one process)
    pp_layout: str | None = None
    stream: bool = False
    cache: str | None = None
    engine_variant: str | None = None

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        *,
        device: Any = None,
        dtype: str | None = None,
        cache: str | None = None,
    ) -> Variant:
        """The model suites' variant of a session (``device``: the resolved device, a
        ``torch.device`` or its name; None: the settings' spec)."""
        return cls(
            engine=settings.engine,
            device=str(device) if device is not None else settings.device,
            dtype=dtype,
            attention=settings.attn_implementation,
            experts=settings.experts_implementation,
            swaps=tuple(settings.swaps),
            compile=compile_spec(settings),
            tp=settings.tp,
            pp=settings.pp,
            stream=settings.stream,
            cache=cache,
        )

    @classmethod
    def for_operators(
        cls, settings: Settings, *, device: Any = None, dtype: str | None = None
    ) -> Variant:
        """The operator suite's variant: the compile variant alone (swaps, attention,
        experts, tensor parallel and caches are the model suites' options)."""
        return cls(
            device=str(device) if device is not None else settings.device,
            dtype=dtype,
            compile=compile_spec(settings),
        )

    def with_changes(self, **changes: Any) -> Variant:
        """This variant with some fields replaced (the decode's cache, the engine's own
        account, an attention implementation a replay path needs)."""
        return replace(self, **changes)

    @property
    def label(self) -> str | None:
        """The variant as records name it in ``swap`` (None: the defaults): the engine's
        account, the swaps, ``attention=``, ``experts=``, ``compile=BACKEND[:MODE]``, ``tp=N``
        (above 1), ``pp=LAYOUT`` (the ranks' layers, ``pp=0-1|2-3``; ``pp=N`` before they are
        known), ``stream`` (streamed weights) and ``cache=NAME``,
        comma-separated in that order."""
        parts = [
            self.engine_variant,
            *self.swaps,
            f"attention={self.attention}" if self.attention else None,
            f"experts={self.experts}" if self.experts else None,
            self.compile.label if self.compile is not None else None,
            f"tp={self.tp}" if self.tp > 1 else None,
            f"pp={self.pp_layout or self.pp}" if self.pp > 1 else None,
            "stream" if self.stream else None,
            f"cache={self.cache}" if self.cache else None,
        ]
        return ",".join(p for p in parts if p) or None

    def record_fields(self) -> dict[str, Any]:
        """The drift record's variant fields (schema 3), ``swap`` holding :attr:`label`.
        Device and dtype are not among them: a record names its own (an operator's integer
        output records int64 in a bfloat16 test; vLLM names the platform's device).
        Streaming and pipeline ranks are named in ``swap`` alone (``stream``, ``pp=...``,
        only when set): they change where the weights are, not the kernels, so the records
        of one process keep their fields as they were."""
        spec = self.compile
        return {
            "swap": self.label,
            "engine": self.engine,
            "engine_variant": self.engine_variant,
            "attention": self.attention,
            "experts": self.experts,
            "swaps": list(self.swaps),
            "compile_backend": spec.backend if spec is not None else None,
            "compile_mode": spec.mode if spec is not None else None,
            "tp": self.tp,
            "cache": self.cache,
        }
