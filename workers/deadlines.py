"""Every object-store request has an end: a request that stalls or trickles is abandoned and
sent again, by TensorStore itself.

What TensorStore offers (0.1.8x): its HTTP transport (libcurl, shared by the ``gcs`` and ``s3``
drivers, every read, write, list and delete) aborts a transfer whose average speed stays below
``TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES`` bytes/s for ``TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS``
seconds (curl's ``CURLOPT_LOW_SPEED_LIMIT`` / ``_TIME``); the driver then retries the request,
on a new connection, under its ``*_request_retries`` policy (``storage.objectstore``), and
fails it once those are spent. Unset -- TensorStore's default -- a request accepted and never
answered waits as long as the connection lives, and one answered at 2 KiB/s for as long as it
trickles. There is no per-request timeout in the context spec, and no way to cancel a request
in flight (cancelling a TensorStore future drops its result, not its HTTP transfer).

The two values are read from the environment **once per process**, when TensorStore makes its
HTTP transport (its first ``gs://`` or ``s3://`` request). :func:`configure` therefore sets them
before that, only where they are not set already: the first dispatcher of a process (or the
first ``gs://`` / ``s3://`` path opened, with the defaults) decides, and a value the user exported
wins. (JAX sets 60 s / 256 B/s the same way on Cloud TPU VMs, so there those hold unless the
variables are exported first.)

Why this cannot make a result wrong: an abandoned request is the same request sent again --
same object name, same bytes, same preconditions (``ifGenerationMatch``, ``If-None-Match``) --
which the server checks again. A data file lands whole or not at all; a commit marker written
twice still has one winner (the server refuses the second); a read returns whole bytes, checked
against their CRC-32C where saved. The worst a deadline does is fail a call that a slower
network would have finished (when every retry of one request is slow): an error, never a wrong
checkpoint.
"""

from __future__ import annotations

import math
import os

STALL_SECONDS = "TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS"
MIN_BYTES_PER_SEC = "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"

DEFAULT_REQUEST_TIMEOUT = 20.0        # seconds a request may go below the floor (Options.request_timeout)
DEFAULT_MIN_REQUEST_RATE = 32 << 10   # bytes/s: the floor (Options.min_request_rate)


def check(request_timeout: float | None, min_request_rate: int) -> None:
    """ValueError unless ``request_timeout`` is None or a finite number > 0 of seconds (no deadline
    is None: an infinite one has no whole seconds for TensorStore) and ``min_request_rate`` an
    integer >= 1 bytes/s (the options' names in the message)."""
    if request_timeout is not None and (isinstance(request_timeout, bool) or
                                        not isinstance(request_timeout, (int, float)) or
                                        not 0 < request_timeout < math.inf):
        raise ValueError(f"request_timeout must be a finite positive number of seconds or None, "
                         f"got {request_timeout!r}")
    if type(min_request_rate) is not int or min_request_rate < 1:
        raise ValueError(f"min_request_rate must be an integer >= 1 (bytes/s), got {min_request_rate!r}")


def configure(request_timeout: float | None = DEFAULT_REQUEST_TIMEOUT,
              min_request_rate: int = DEFAULT_MIN_REQUEST_RATE) -> None:
    """Ask TensorStore to abandon (and retry) any HTTP request slower than ``min_request_rate``
    bytes/s for ``request_timeout`` seconds (whole seconds, rounded up): sets the two variables
    the module's docstring names where they are not set. ``request_timeout=None``: leaves both
    alone (TensorStore's default: no deadline). Takes effect only before TensorStore's first
    HTTP request in this process; never changes a value already set."""
    check(request_timeout, min_request_rate)
    if request_timeout is None:
        return
    os.environ.setdefault(STALL_SECONDS, str(max(1, math.ceil(request_timeout))))
    os.environ.setdefault(MIN_BYTES_PER_SEC, str(min_request_rate))


def in_effect() -> str:
    """The request deadline this process's TensorStore uses, in words (for error messages:
    what was tried), from the variables as they are now."""
    seconds, rate = os.environ.get(STALL_SECONDS), os.environ.get(MIN_BYTES_PER_SEC)
    if not seconds and not rate:
        return "no request deadline (TensorStore's default)"
    return f"each request abandoned and retried after {seconds or 30} s below {rate or 1} bytes/s"
