"""IoLoopTrace: where a TransferAgent's I/O thread spends its time, for profiling (`NixlConfig.io_trace_path`).

Each loop iteration that made a call becomes one JSON line: when it woke (unix seconds), how much later than the
wait it asked for (a thread that wakes must take the GIL back before it runs), and per kind of call (`check`:
NIXL's check_xfer_state, `post`: make_prepped_xfer + transfer, `notif`: get_new_notifs, `event`: a CUDA event
query) how many, their total and their longest duration, plus how many handles were seen done. NIXL's Python
binding releases the GIL around each call, so a call's duration includes taking the GIL back: long calls while
the forward thread runs Python are GIL waits, not NIXL's work. Lines go to the file only while the loop is idle
(no write queued or in flight), never between a post and its completion; at most `max_rows` are buffered.
"""

from __future__ import annotations

import json
import os
import time

_DEFAULT_MAX_ROWS = 200_000


class IoLoopTrace:
    """Per-iteration records of one I/O thread (that thread only), appended as JSON lines to `path`."""

    def __init__(self, path: str, agent_name: str, max_rows: int = _DEFAULT_MAX_ROWS) -> None:
        """`path` may hold `{pid}` and `{agent}`, filled in here; its folder is created."""
        self.path = path.replace("{pid}", str(os.getpid())).replace("{agent}", agent_name)
        folder = os.path.dirname(self.path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        self._max_rows = max_rows
        self._rows: list[str] = []
        self._dropped = 0
        self._woke = 0.0
        self._late_s = 0.0
        self._calls: dict[str, list[float]] = {}  # kind -> [count, total seconds, longest seconds]
        self._done = 0

    def woke(self, late_s: float) -> None:
        """A new iteration starts; it woke `late_s` after the wait it asked for ended (0 when a command woke it)."""
        self._woke = time.time()
        self._late_s = max(0.0, late_s)
        self._calls = {}
        self._done = 0

    def call(self, kind: str, seconds: float) -> None:
        """One call of `kind` took `seconds` (GIL hand-back included)."""
        entry = self._calls.get(kind)
        if entry is None:
            self._calls[kind] = [1, seconds, seconds]
        else:
            entry[0] += 1
            entry[1] += seconds
            if seconds > entry[2]:
                entry[2] = seconds

    def handle_done(self) -> None:
        """A check found a handle done."""
        self._done += 1

    def end_iteration(self, busy: bool) -> None:
        """Keep this iteration's record (when it made a call); write the buffer out once the loop is idle."""
        if self._calls:
            if len(self._rows) < self._max_rows:
                row = {"t": round(self._woke, 6), "late_ms": round(self._late_s * 1e3, 3), "done": self._done,
                       **{kind: [int(c), round(total * 1e3, 3), round(longest * 1e3, 3)]
                          for kind, (c, total, longest) in self._calls.items()}}
                self._rows.append(json.dumps(row, separators=(",", ":")))
            else:
                self._dropped += 1
        if not busy and self._rows:
            self.flush()

    def flush(self) -> None:
        """Append the buffered lines to the file."""
        rows, self._rows = self._rows, []
        if not rows and not self._dropped:
            return
        if self._dropped:
            rows.append(json.dumps({"dropped_rows": self._dropped}))
            self._dropped = 0
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")
