"""Pickled messages between the ranks of a gloo process group.

gloo's send/recv moves tensors whose size the receiver knows, so a message is its length (one
int64) and then its pickled bytes. Each neighbour has a thread that sends (messages to it go out
in order while the caller computes on) and one that receives (into one inbox, in arrival order):
the pipeline's overlap of compute and transfer, as a stage peer of the swarm has it.

A link's delay where the kernel has no netem is added here, on the send path as the swarm's
peers add it: a message leaves `delay_s` after it was handed over, and messages queued behind it
are not held up by its delay, only by its transfer.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections import Counter

import torch
import torch.distributed as dist


class Mailbox:
    def __init__(self, neighbours: list[int], delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.inbox: queue.Queue = queue.Queue()
        self.sent: Counter = Counter()  # bytes handed to gloo per destination rank (with the length)
        self._outboxes = {rank: queue.Queue() for rank in neighbours}
        self._senders = [
            threading.Thread(target=self._send_loop, args=(rank,), name=f"gloo-send-{rank}", daemon=True)
            for rank in neighbours
        ]
        for rank in neighbours:
            threading.Thread(target=self._receive_loop, args=(rank,), name=f"gloo-recv-{rank}", daemon=True).start()
        for thread in self._senders:
            thread.start()

    def send(self, rank: int, message) -> None:
        """Queues `message` for rank `rank`; returns at once."""
        self._outboxes[rank].put((time.monotonic() + self.delay_s, pickle.dumps(message, protocol=5)))

    def receive(self, timeout: float | None = None) -> tuple[int, object]:
        """(source rank, message), the next to arrive from any neighbour; raises what a receiving
        thread met (a neighbour gone: gloo's connection error)."""
        source, message = self.inbox.get(timeout=timeout)
        if isinstance(message, BaseException):
            raise message
        return source, message

    def flush(self) -> None:
        """Returns once everything queued so far has gone out."""
        for outbox in self._outboxes.values():
            outbox.put(None)
        for thread in self._senders:
            thread.join()

    def _send_loop(self, rank: int) -> None:
        outbox = self._outboxes[rank]
        while (item := outbox.get()) is not None:
            ready, data = item
            if (wait := ready - time.monotonic()) > 0:
                time.sleep(wait)
            dist.send(torch.tensor([len(data)], dtype=torch.int64), rank)
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), rank)
            self.sent[rank] += len(data) + 8

    def _receive_loop(self, rank: int) -> None:
        try:
            while True:
                size = torch.empty(1, dtype=torch.int64)
                dist.recv(size, rank)
                data = torch.empty(int(size), dtype=torch.uint8)
                dist.recv(data, rank)
                self.inbox.put((rank, pickle.loads(data.numpy().tobytes())))
        except Exception as e:  # the process group went down: the main thread hears of it
            self.inbox.put((rank, ConnectionError(f"rank {rank}: {type(e).__name__}: {e}")))
