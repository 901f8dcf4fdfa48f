"""A capture's progress: a bar on a terminal, one line per step in a log, a line while a long
step runs, nothing when asked for nothing."""

from __future__ import annotations

import sys
import time

#: Seconds a capture step may run before a line says it is still running (a long request's
#: forward, a calibration member, a big model's load take minutes: never silent that long).
HEARTBEAT_S = 30.0


class Progress:
    """Progress of a capture, one step per request forward and per calibration member (with
    the dtypes it calibrates): a bar on a terminal (tqdm, which transformers brings), one
    flushed line per step on stderr elsewhere (a CI log shows the capture advancing), nothing
    with ``mode`` "off". A step that lasts longer than ``heartbeat`` seconds is never silent:
    a line (a refreshed bar on a terminal) says which step is still running and for how long,
    every ``heartbeat`` seconds; ``close(done=True)`` prints the total time."""

    def __init__(self, mode: str, total: int, name: str, heartbeat: float = HEARTBEAT_S) -> None:
        import threading

        from tqdm import tqdm

        self.mode, self.total, self.name, self.done = mode, total, name, 0
        self.text = "starting"
        self.started = self.since = time.monotonic()
        self.bar = tqdm(total=total, desc=f"capture {name}", unit="step",
                        disable=mode != "bar")  # fmt: skip
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat_every, args=(heartbeat,), daemon=True)
        if mode != "off":
            self._beats.start()

    def step(self, text: str) -> None:
        self.done += 1
        self.text, self.since = text, time.monotonic()
        self.bar.set_postfix_str(text)
        self.bar.update(1)
        self._line(f"step {self.done}/{self.total}: {text}")

    def beat(self) -> None:
        """Says the running step is still running (a line; on a terminal, the bar's clock)."""
        self.bar.refresh()
        running = time.monotonic() - self.since
        self._line(f"still on step {self.done}/{self.total} after {running:.0f} s: {self.text}")

    def close(self, done: bool = False) -> None:
        self._stop.set()
        self.bar.close()
        if done:
            self._line(f"done, {self.total} steps")

    def _line(self, text: str) -> None:
        if self.mode == "lines":
            elapsed = time.monotonic() - self.started
            print(f"numalign capture {self.name}: {text} ({elapsed:.0f} s so far)",
                  file=sys.stderr, flush=True)  # fmt: skip

    def _beat_every(self, seconds: float) -> None:
        while not self._stop.wait(seconds):
            self.beat()


def progress_mode(progress: bool | None) -> str:
    """None: a bar on a terminal, lines in a log; True: the bar; False: silent."""
    if progress is None:
        return "bar" if sys.stderr.isatty() else "lines"
    return "bar" if progress else "off"
