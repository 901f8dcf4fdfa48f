"""Replay on the device: calibration, layer and full-model replay, decode, kernel swap,
tensor parallel, the engines, and the model verdict's drift records (``replay.verdict``; the
verdict itself is ``compare.model_verdict``). Device policy and compilation are
``numalign.runtime``'s."""
