"""Work a push does not wait for (readying the next lease) runs at the lowest CPU priority,
until a push does wait for it: on a host whose cores the engine also uses, it then yields to
the engine instead of slowing the first requests on the version just pushed."""
from __future__ import annotations

import os
import threading

LOWEST = 19  # nice value


class Yielding:
    """The CPU priority of one worker thread: `lower` from inside it, `lift` from a thread
    that must now wait for its work. Where the OS refuses (lifting needs CAP_SYS_NICE or
    RLIMIT_NICE), the thread keeps the priority it has."""

    def __init__(self):
        self._tid: int | None = None
        self._own: int = 0

    def lower(self) -> None:
        tid = threading.get_native_id()  # Linux: setpriority on a thread id is per thread
        try:
            # its own priority is read once: lowered again without a lift, it reads LOWEST
            own = self._own if tid == self._tid else os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, LOWEST)
        except OSError:
            return
        self._tid, self._own = tid, min(own, LOWEST)

    def lift(self) -> None:
        self._set(self._own)

    def drop(self) -> None:
        """`lower` again, from a thread that no longer waits for the worker's work."""
        self._set(LOWEST)

    def _set(self, priority: int) -> None:
        if self._tid is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, self._tid, priority)
            except OSError:
                pass
