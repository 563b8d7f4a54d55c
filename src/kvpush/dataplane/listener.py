"""NotificationListener: the decode side's view of NIXL notifications.

Life cycle: build it on a started TransferAgent; from then on the agent's I/O thread polls
`get_new_notifs()` every `notif_poll_s` (which also drives UCX progress when NIXL's progress thread
is off) and calls `on_notification(agent_name, message)` for each message, in arrival order per
sender. Messages that arrived before the listener existed are delivered first. Callbacks run on the
I/O thread: hand work off, never block there.

Receiving pushes needs nothing else: the writes are one-sided, and the notification is only the
fast path for "transfer complete" (the directory's completion event is the authoritative one).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpush.dataplane.agent import TransferAgent


class NotificationListener:
    """Delivers every NIXL notification the agent receives to `on_notification`."""

    def __init__(self, agent: TransferAgent, on_notification: Callable[[str, bytes], None]) -> None:
        """Start delivering `agent`'s notifications to `on_notification(agent_name, message)`."""
        self._agent = agent
        self._callback = on_notification
        self._received = 0
        agent.add_notification_callback(self._deliver)

    @property
    def received_count(self) -> int:
        """Messages delivered so far."""
        return self._received

    def stop(self) -> None:
        """Stop delivering (a message the I/O thread is delivering now may still arrive)."""
        self._agent.remove_notification_callback(self._deliver)

    def _deliver(self, agent_name: str, message: bytes) -> None:
        self._received += 1
        self._callback(agent_name, message)
