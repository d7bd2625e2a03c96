"""One answer for every process: a save decision that reads a clock is made by process 0.

Hosts' clocks drift. If each process of a job asked ``EveryNSeconds(900)`` itself, one could
save at step 1200 and another not, and the save would wait forever for the missing ones. So
in a multi-process job a clock-reading decision is taken by process 0 and published through
the coordination service (``dispatch_io/manager/<root>/save/<step>``); the others wait for it
(at most ``timeout`` seconds, then ``BarrierTimeoutError``). Decisions that read no clock
are the same everywhere by construction and cost nothing.

Process 0 removes the decision of the step it published :data:`WINDOW` decisions earlier, so
the service holds a bounded number of keys however long the run: processes more than that
many decisions apart (a training step has collectives, so they are not) would time out.
"""

from __future__ import annotations

import collections
import hashlib
import json
from typing import Callable

from dispatch_io.errors import BarrierTimeoutError

WINDOW = 64


class SharedDecisions:
    """Process 0's answers, shared. ``client``: the coordination service client (None: one
    process, nothing to share); ``root``: the manager's root, keeping managers apart."""

    def __init__(self, client, process: int, root: str, timeout: float):
        self.client, self.process, self.timeout = client, process, timeout
        self.prefix = f"dispatch_io/manager/{hashlib.sha256(root.encode()).hexdigest()[:24]}/save/"
        self._published: collections.deque[str] = collections.deque()

    def decide(self, step: int, decide: Callable[[], bool]) -> bool:
        """``decide()`` on process 0 (or alone), its answer everywhere."""
        if self.client is None:
            return decide()
        key = f"{self.prefix}{step}"
        if self.process == 0:
            answer = decide()
            self.client.key_value_set(key, json.dumps(answer), allow_overwrite=True)
            self._published.append(key)
            if len(self._published) > WINDOW:
                self.client.key_value_delete(self._published.popleft())
            return answer
        try:
            return json.loads(self.client.blocking_key_value_get(key, int(self.timeout * 1000)))
        except Exception as exc:  # noqa: BLE001 - the service's errors have no type of their own
            raise BarrierTimeoutError(f"process 0 did not decide whether to save step {step} within "
                                      f"{self.timeout:g} s (does every process call should_save at every "
                                      "step?)", processes=[0], barrier=key) from exc
