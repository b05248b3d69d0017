"""Ctrl-C (SIGINT) and SIGTERM end a flowmoe command the same way: the command's
`finally` blocks run (results and the trace are written), one message is
printed and the exit code is 128 + the signal number (130, 143).

`main` installs the handlers before it imports torch. Until `armed()` is
entered, a signal is only noted: an exception raised in Python code that C++
called during an import can abort the interpreter. Entering `armed()` raises
a noted signal at once; inside it the first signal raises `Interrupted`, and
later ones are only noted so that the cleanup it starts runs to its end.

A handler raises wherever the main thread is, and in a few places Python drops
the exception after printing "Exception ignored": a weakref callback (a kernel
wrapper's cache forgetting a tensor that died, kernels/native.py `Facts`), a
`__del__`. Such an `Interrupted` is sent again (sys.unraisablehook, while
armed), so the command still ends as interrupted instead of running on.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)
RESEND_S = 0.001  # how soon a dropped Interrupted's signal is sent again (from a timer thread)


class Interrupted(KeyboardInterrupt):
    """A SIGINT or SIGTERM; a KeyboardInterrupt, so asyncio and the job treat both like Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class SignalGate:
    def __init__(self) -> None:
        self.noted: int | None = None
        self.open = False

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.open:  # the first signal raises; later ones wait, so cleanup still writes the trace
            self.open = False
            raise Interrupted(signum)
        self.noted = self.noted or signum

    @contextmanager
    def installed(self) -> Iterator[SignalGate]:
        """The handlers for the block, the previous ones restored after it."""
        if threading.current_thread() is not threading.main_thread():  # only it may set handlers
            yield self
            return
        ignored = {s for s in SIGNALS if signal.getsignal(s) == signal.SIG_IGN}  # e.g. nohup: stay so
        previous = {s: signal.signal(s, self.handle) for s in SIGNALS if s not in ignored}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.open = True
        dropped = sys.unraisablehook
        sys.unraisablehook = partial(self._resend, dropped)
        try:
            if self.noted is not None:
                raise Interrupted(self.noted)
            yield
        finally:
            self.open = False
            sys.unraisablehook = dropped

    def _resend(
        self, previous: Callable[[sys.UnraisableHookArgs], object], unraisable: sys.UnraisableHookArgs
    ) -> None:
        """sys.unraisablehook while armed: an Interrupted that Python dropped re-arms the gate and its
        signal is sent again from a timer thread, so that the handler raises it once the main thread
        is back outside the callback; anything else goes to `previous`."""
        error = unraisable.exc_value
        if not isinstance(error, Interrupted):
            previous(unraisable)
            return
        self.open = True
        threading.Timer(RESEND_S, self._send, (error.signum,)).start()

    def _send(self, signum: int) -> None:
        """The signal again, unless the gate closed meanwhile (the command's cleanup has begun)."""
        if self.open:
            os.kill(os.getpid(), signum)
