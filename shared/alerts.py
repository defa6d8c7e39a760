"""Alerts: always logged and published on `sked.events` (routing key `alert.<name>`), and
posted to Alertmanager's API v2 (`POST /api/v2/alerts`) when SKED_ALERTMANAGER_URL is set.

Every alert carries the labels `alertname`, `severity` and `service="sked"` plus its own
(`node`, `task_id`, `mode`), and the annotations `summary` and `description`. A firing alert
with an end (`ends_at`, e.g. a degrade mode's until) resolves by itself; one without is
resolved by sending it again with `resolved=True`. Times are Postgres's where the alert has
one (a row's timestamps), never a guess of this host's clock against another's.

The names (docs/architecture.md, "Alerts"):
  SkedDegraded        a degrade mode is in force (resolved when it ends)        warning
  SkedTaskLost        an attempt was declared lost                              warning
  SkedNodeLost        a node stopped heartbeating or turned not ready           warning
  SkedOutboxBacklog   events waiting to be published past the bound             critical
  SkedReadyBacklog    tasks waiting in Ready past the bound                     warning
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Protocol

import aiohttp

from shared.bus import EVENTS_EXCHANGE, Outgoing
from shared.errors import one_line
from shared.redact import masked

log = logging.getLogger(__name__)

POST_TIMEOUT_S = 5.0
# Alerts waiting for Alertmanager, at most: past it the oldest are dropped (and counted in the
# log). Posted by a task of their own, POST_BATCH a request: the work that raised them (a
# recovery pass, the degrade evaluator) never waits for Alertmanager.
MAX_PENDING = 10_000
POST_BATCH = 500


@dataclass(frozen=True)
class Alert:
    name: str
    severity: str
    summary: str
    description: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    starts_at: datetime | None = None
    ends_at: datetime | None = None
    resolved: bool = False

    def all_labels(self) -> dict[str, str]:
        return {
            "alertname": self.name,
            "severity": self.severity,
            "service": "sked",
            **{k: str(v) for k, v in self.labels.items()},
        }

    def wire(self, now: datetime) -> dict[str, Any]:
        """Alertmanager's API v2 form (a resolved alert ends `now`, Postgres time)."""
        out: dict[str, Any] = {
            "labels": self.all_labels(),
            "annotations": {"summary": self.summary, "description": self.description},
        }
        if self.starts_at is not None:
            out["startsAt"] = _rfc3339(self.starts_at)
        ends = now if self.resolved else self.ends_at
        if ends is not None:
            out["endsAt"] = _rfc3339(ends)
        return out


def _rfc3339(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


class Publisher(Protocol):
    """What the alerter publishes events with (shared.bus.AmqpBus)."""

    async def publish(self, exchange: str, messages: Sequence[Outgoing]) -> None: ...


class Alerter:
    def __init__(self, bus: Publisher | None, url: str | None) -> None:
        self.bus = bus
        self.url = url.rstrip("/") if url else None
        self._session: aiohttp.ClientSession | None = None
        self._pending: deque[dict[str, Any]] = deque(maxlen=MAX_PENDING)
        self._posting: asyncio.Task[None] | None = None
        self._dropped = 0

    async def send(self, alerts: Sequence[Alert], now: datetime) -> None:
        """Log, publish and post `alerts` (`now`: Postgres time). Never raises: an alert
        that cannot be delivered is logged, and the work that raised it goes on."""
        if not alerts:
            return
        for alert in alerts:
            state = "resolved" if alert.resolved else "firing"
            log.warning("alert %s %s: %s", alert.name, state, alert.summary)
        wire = [a.wire(now) for a in alerts]
        if self.url is not None:
            # queued first: a broker slow to confirm (seconds) held these back, and alerts
            # sent later (a newer degrade mode's) could reach Alertmanager before them
            self._queue(wire)
        if self.bus is not None:
            messages = [
                Outgoing(f"alert.{a.name}", json.dumps(w).encode())
                for a, w in zip(alerts, wire, strict=True)
            ]
            try:
                await self.bus.publish(EVENTS_EXCHANGE, messages)
            except Exception as exc:  # an alert is not worth failing the caller for
                log.error("alerts not published: %s", one_line(exc))

    def _queue(self, wire: list[dict[str, Any]]) -> None:
        """Hand alerts to the poster: a flood of them, or an Alertmanager that does not answer
        (each try waits up to POST_TIMEOUT_S), held up recovery's pass for minutes."""
        room = MAX_PENDING - len(self._pending)
        if len(wire) > room:
            self._dropped += len(wire) - room
            log.error("%d alerts dropped: Alertmanager is behind", self._dropped)
        self._pending.extend(wire)
        if self._posting is None or self._posting.done():
            self._posting = asyncio.create_task(self._post_pending())

    async def _post_pending(self) -> None:
        while self._pending:
            batch = [self._pending.popleft() for _ in range(min(POST_BATCH, len(self._pending)))]
            await self._post(batch)

    async def flush(self, timeout: float = POST_TIMEOUT_S) -> None:
        """Wait (at most `timeout`) until what was queued has been posted or given up."""
        if self._posting is not None and not self._posting.done():
            await asyncio.wait({self._posting}, timeout=timeout)

    async def _post(self, wire: list[dict[str, Any]]) -> None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S)
            )
        url = f"{self.url}/api/v2/alerts"
        try:
            # not followed: a redirected POST turns into a GET that Alertmanager answers 200
            # with its alerts, and ours would be dropped without a word
            async with self._session.post(url, json=wire, allow_redirects=False) as resp:
                if 300 <= resp.status < 400:
                    log.error(
                        "Alertmanager refused %d alert(s): %s redirects to %s (set "
                        "SKED_ALERTMANAGER_URL to where it points)",
                        len(wire),
                        resp.status,
                        masked(resp.headers.get("Location", "?")),
                    )
                elif resp.status >= 300:
                    # a proxy's error page may be in any charset, and of any size: only
                    # what is logged is read
                    body = (await resp.content.read(300)).decode("utf-8", errors="replace")
                    log.error(
                        "Alertmanager refused %d alert(s): %s %s", len(wire), resp.status, body
                    )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.error("Alertmanager not reached (%s): %s", masked(self.url or ""), one_line(exc))
        except Exception as exc:  # the poster must outlive any one answer
            log.error("Alertmanager post failed (%s): %s", masked(self.url or ""), one_line(exc))

    async def close(self) -> None:
        await self.flush()
        if self._posting is not None:
            self._posting.cancel()
            # what killed the poster was logged by it; closing must not fail the caller
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._posting
        if self._session is not None:
            await self._session.close()
            self._session = None
