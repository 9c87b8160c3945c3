"""One channel's claimed rows on their way out, and its deliveries until they settle.

A claim fills a per-queue buffer with as many rows as the consumer has free prefetch
slots; the rows go out one at a time, those of one partition key one after another.
Each delivered row is kept by its delivery tag until the consumer settles it; then its
prefetch slot and partition key come free. Nothing of kombu here: the channel
(:mod:`.channel`) hands over messages and asks for settlements in kombu's words.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from time import time
from typing import Any

from .broker import Broker, QueueTable
from .codec import EXPIRES_KEY, decode_stored
from .rows import ClaimedRow, Held, Settlement


class Deliveries:
    """A channel's buffered rows and unsettled deliveries (settlements from any thread)."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.buffers: dict[str, deque[ClaimedRow]] = {}
        #: partition keys with a delivered, unsettled row: their next rows wait
        self.busy_keys: set[tuple[str, Any]] = set()
        #: the last claim was skipped for want of a free prefetch slot
        self.starved = False
        #: the delivered rows by delivery tag, until settled
        self._rows: dict[Any, tuple[Held, ClaimedRow]] = {}

    # -- into the buffer, and out of it ------------------------------------------
    def claim(self, table: QueueTable, buffer: deque[ClaimedRow], free: int | None,
              consuming: bool) -> int | None:
        """Claim as many rows of ``table`` into its ``buffer`` as may go out (``free``: the
        free prefetch slots, None without a limit); how many came. None: no slot is free
        (the next settlement wakes the consumer)."""
        limit = self._claim_size(free, consuming)
        if limit <= 0:
            self.starved = True
            return None
        claimed = self.broker.claim(table, limit, self._keys_in_work(table.queue))
        buffer.extend(claimed)
        if (claimed and not table.transient
                and self.broker.pauses.paused_after_claim(table.queue)):
            self.release_buffered([table.queue])  # paused while it claimed: none goes out
            return 0
        return len(claimed)

    def _claim_size(self, free: int | None, consuming: bool) -> int:
        """Free prefetch slots (None: no limit) less the buffered rows that can go out
        next; one for a plain basic_get. Rows held back behind their key's row in work
        take no slot, so other keys get them."""
        if free is None:
            free = self.broker.options.max_batch if consuming else 1
        keyless, next_keys = 0, set()
        for queue, buffer in self.buffers.items():
            for row in buffer:
                if row.partition_key is None:
                    keyless += 1
                elif (queue, row.partition_key) not in self.busy_keys:
                    next_keys.add((queue, row.partition_key))  # its first row goes out next
        return min(free - keyless - len(next_keys), self.broker.options.max_batch)

    def _keys_in_work(self, queue: str) -> list[Any]:
        """The queue's partition keys with a row in work here: a claim passes over their
        rows, which would only wait in the buffer (at most one claim's worth waits per key)."""
        return [key for name, key in self.busy_keys.copy() if name == queue]

    def ready(self, besides: str) -> bool:
        """Whether a queue other than ``besides`` has a buffered row that can go out now."""
        return any(row.partition_key is None or (name, row.partition_key) not in self.busy_keys
                   for name, buffer in list(self.buffers.items()) if name != besides
                   for row in list(buffer))

    def next_free(self, queue: str, buffer: deque[ClaimedRow]) -> ClaimedRow | None:
        """The first buffered row whose partition key has nothing in work here: rows
        of one key go out one after another, in claim order; other keys pass them. None
        once the queue is seen paused: its rows claimed before (waiting behind their key)
        go back to the table."""
        if buffer and self.broker.pauses.seen_paused(queue):
            self.release_buffered([queue])
            return None
        for index, row in enumerate(buffer):
            if row.partition_key is None:
                del buffer[index]
                return row
            key = (queue, row.partition_key)
            if key not in self.busy_keys:
                del buffer[index]
                self.busy_keys.add(key)
                return row
        return None

    def deliverable(self, table: QueueTable, row: ClaimedRow, tag: Any) -> dict[str, Any] | None:
        """The message of a claimed row, delivered as ``tag``, or None when the row went to
        its dead-letter queue (delivered too often, or undecodable)."""
        held = self.broker.held_for(table, row)
        message = self.broker.admit(held, row, lambda: decode_stored(row, table, tag))
        if message is None:
            self.key_settled(table.queue, row)
            return None
        expires_at = message.pop(EXPIRES_KEY, None)
        if expires_at is not None and expires_at <= time():
            self._expire(held, row)
            return None
        self._rows[tag] = (held, row)
        return message

    def _expire(self, held: Held, row: ClaimedRow) -> None:
        """An expired message is not delivered: it goes to its queue's dead-letter queue
        when it has one (as RabbitMQ dead-letters expired messages), else it is completed."""
        if held.table.options.dead_letter_queue:
            self.broker.dead_letter(held, row, "expired")
        else:
            self.broker.settle(Settlement.COMPLETE, held)
        self.key_settled(held.table.queue, row)

    def release_buffered(self, queues: list[str]) -> int:
        """Rows claimed but never handed to kombu go back with their attempt returned;
        how many. Each buffer is emptied in place: a round that gave rows back for a pause
        may read the resume and claim again into the buffer it holds, whose rows must stay
        where the next rounds look."""
        released = 0
        for queue in queues:
            buffer = self.buffers.get(queue)
            if not buffer:  # nothing to give back: the queue may be gone meanwhile
                continue
            table = self.broker.table(queue)
            while buffer:
                row = buffer.popleft()
                self.broker.settle(Settlement.RELEASE_UNCOUNTED, self.broker.held_for(table, row))
                released += 1
        return released

    # -- settled ---------------------------------------------------------------
    def holds(self, delivery_tag: Any) -> bool:
        """Whether the delivery is not settled yet."""
        return delivery_tag in self._rows

    def unsettled(self) -> list[Any]:
        """The tags of the deliveries not settled yet (a copy: settlements may come from
        other threads meanwhile)."""
        return list(self._rows)

    def settle(self, delivery_tag: Any, settle: Callable[[Held, ClaimedRow], None],
               was_full: bool) -> None:
        """The one way a delivery leaves (any thread): the broker settles its row, and its
        prefetch slot (``was_full``: none was free) and partition key come free, waking a
        consumer that waits for either, even when the settlement fails."""
        found = self._rows.pop(delivery_tag, None)
        if found is None:
            return
        held, row = found
        try:
            settle(held, row)
        finally:
            self.key_settled(held.table.queue, row)
            self.slot_freed(was_full)

    def slot_freed(self, was_full: bool) -> None:
        """A prefetch slot came free (any thread): wake the consumer if it stopped claiming
        for want of one, rather than let it sleep a whole polling interval."""
        if was_full or self.starved:
            self.starved = False
            self.broker.wakeup.poke()

    def key_settled(self, queue: str, row: ClaimedRow) -> None:
        """A row left this process: its partition key may send the next row (any thread)."""
        if row.partition_key is not None:
            self.busy_keys.discard((queue, row.partition_key))
            self.broker.wakeup.poke()
