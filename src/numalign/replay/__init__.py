"""Replay on the device: calibration, layer and full-model replay, decode, kernel swap,
tensor parallel, the engines, and the model verdict (``replay.verdict``). Device policy and
compilation are ``numalign.runtime``'s."""
