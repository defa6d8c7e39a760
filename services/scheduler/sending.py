"""Sending what a pass placed: one dispatch message per node, after the commit that placed
it, and the attempts of a message RabbitMQ did not take back to Ready (shared.dispatches has
the message)."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import aiormq.exceptions

from services.scheduler.hub import Part
from shared import fsm, hooks
from shared.bus import DISPATCH_EXCHANGE, PUBLISH_TIMEOUT_S, AmqpBus, Outgoing
from shared.dispatches import LINE_HEADER, MAX_DISPATCHES, entry_of, pack
from shared.fsm import State
from shared.models import Task
from shared.resilience import TRANSIENT
from shared.throttle import Throttled

log = logging.getLogger(__name__)

# A node whose dispatches came back (no queue bound for it) is passed over this long: its
# executor declares its queue again within a few heartbeats (executor/serving.py), or the
# node's row goes stale; placing there meanwhile took every attempt back, pass after pass.
UNROUTABLE_S = 10.0


class Sender(Part):
    bus: AmqpBus
    _unroutable = Throttled(log)

    async def send(self, moved: list[Task]) -> None:
        """After COMMIT: one dispatch message per node, returning once RabbitMQ has confirmed
        them. The attempts of a message it did not take are taken back to Ready; the other
        nodes' stand. A message returned (no queue bound for its node: its executor gone, or
        its queue deleted) marks its node unroutable for UNROUTABLE_S, so that the passes do
        not place there again at once (hub.unroutable); any other failure is raised after the
        take-back (a broker away, a nack, no confirm in time)."""
        if not moved:
            return
        headers, handles = hooks.dispatching(moved)
        for task, h in zip(moved, headers, strict=True):
            h[LINE_HEADER] = repr(self.queue.score_of(task))
        messages, carried = _dispatches(moved, headers)
        try:
            outcomes = await self.bus.publish_each(DISPATCH_EXCHANGE, messages, PUBLISH_TIMEOUT_S)
        except BaseException:
            await self._take_back(moved)
            raise
        finally:
            hooks.finished(handles)
        failed = [
            (m, out, some)
            for m, out, some in zip(messages, outcomes, carried, strict=True)
            if out is not None
        ]
        if not failed:
            return
        await self._take_back([t for _, _, some in failed for t in some])
        raised = None
        for message, error, _ in failed:
            if isinstance(error, aiormq.exceptions.PublishError):  # returned: no route
                self.hub.unroutable[message.routing_key] = time.monotonic() + UNROUTABLE_S
                self._unroutable.warning(
                    "dispatches to node %s came back: no queue is bound for it (its executor "
                    "gone, or its queue deleted); not placing there for %g s",
                    message.routing_key,
                    UNROUTABLE_S,
                )
            else:
                raised = raised or error
        if raised is not None:
            raise raised

    async def _take_back(self, moved: list[Task]) -> None:
        """The dispatches may not have gone out (RabbitMQ away): put the attempts back in line
        rather than leave them to the stuck-in-Scheduling sweep. A dispatch that did arrive
        then loses its start CAS, so nothing runs twice."""
        with contextlib.suppress(*TRANSIENT):
            back = await self.store.tasks.transition_many(
                [fsm.plan(t, State.READY, "dispatch not confirmed") for t in moved]
            )
            await self.queue.push(back)


def _dispatches(
    moved: list[Task], headers: list[dict[str, Any]]
) -> tuple[list[Outgoing], list[list[Task]]]:
    """One message per node, carrying the attempts placed there (shared.dispatches); and
    the tasks each message carries."""
    by_node: dict[str, list[tuple[Task, dict[str, Any], dict[str, Any]]]] = {}
    for task, h in zip(moved, headers, strict=True):
        body = entry_of(task)
        by_node.setdefault(body["node"], []).append((task, body, h))
    messages: list[Outgoing] = []
    carried: list[list[Task]] = []
    for node, some in by_node.items():
        for i in range(0, len(some), MAX_DISPATCHES):
            part = some[i : i + MAX_DISPATCHES]
            messages.append(Outgoing(node, pack([(body, h) for _, body, h in part])))
            carried.append([task for task, _, _ in part])
    return messages, carried
