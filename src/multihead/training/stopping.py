"""Stopping a run between steps: SIGINT (Ctrl-C) and SIGTERM set a flag the loop checks."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["StopRequest"]


class StopRequest:
    """SIGINT/SIGTERM set a flag the loop checks between steps.

    A second SIGINT (with ``escalate``) raises KeyboardInterrupt, but only while ``abandonable``
    (the step's forward and backward pass, which change no weights); elsewhere it is noted and
    the loop stops after the step, so a saved checkpoint never holds half an update.
    """

    def __init__(self, *, escalate: bool) -> None:
        self.requested = False
        self.escalate = escalate
        self.abandonable = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.escalate and signum == signal.SIGINT and self.abandonable:
            self.abandonable = False
            raise KeyboardInterrupt  # a second Ctrl-C: abandon this step
        self.requested = True

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be set from the main thread
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
