"""A request as the server's scheduler sees it (:class:`Job`), and the scheduler's answers to the
HTTP layer: queue full (429), shutting down (503), a decoder's validation error (400), a timeout
(408) or cancellation."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from unmask.decode.engine.running import Request
from unmask.errors import UnmaskError
from unmask.serve.errors import ApiError
from unmask.serve.protocol import api_message, named_param

_ids = itertools.count()


@dataclass(eq=False, kw_only=True)
class Job(Request):
    """One request as the scheduler sees it: a running decoder's
    :class:`~unmask.decode.engine.running.Request` (prompt_ids, max_new_tokens, sampling, stop strings,
    generator, logprobs, logit_bias, grammar) and what the scheduler keeps beside it.

    decoder, options: the decoder and its knobs; deadline: ``time.monotonic()`` after which the request
    times out. ``post(kind, payload)`` delivers an event to the waiting HTTP handler (thread-safe);
    ``group``: the HTTP request it belongs to (its ``n`` choices share a per-call batch, whose decode
    gives them the generators they would get together)."""

    decoder: str
    options: dict
    deadline: float
    post: object
    id: int = field(default_factory=lambda: next(_ids))
    cancelled: threading.Event = field(default_factory=threading.Event)
    closed: bool = False  # set by the scheduler after the final event
    sizable: bool = False  # set by the scheduler: greedy lossless sbd whose K follows the load
    running_key: tuple | None = None  # set by the scheduler: the running batch it joins (None: per call)
    config: object = None  # set by the scheduler: its decoder's config, which builds the batch it opens
    grammar_field: str | None = None  # the request field that gave ``grammar``: the param of its errors
    group: object = None
    logprobs_posted: int = 0  # set by the scheduler: how many of its row's logprobs went out with "logprobs" events

    def cancel(self) -> None:
        """Ask the scheduler to drop this request at its next step boundary (thread-safe)."""
        self.cancelled.set()

    @property
    def gone(self) -> bool:
        return self.cancelled.is_set() or time.monotonic() > self.deadline

    @property
    def events(self) -> bool:
        """Whether its running batch builds step events for it (an AR row streams through ``on_token``)."""
        return self.decoder != "ar"

    def batch_key(self) -> tuple:
        """Requests with equal keys can share one per-call ``decode``."""
        solo = (self.group if self.group is not None else self.id) if not self.sampling.greedy else None
        bias = None if self.logit_bias is None else tuple(sorted(self.logit_bias.items()))
        return (self.decoder, tuple(sorted(self.options.items())), self.sampling, self.max_new_tokens,
                self.stop, solo, self.logprobs, bias)

    def finish(self, kind: str, payload) -> None:
        if not self.closed:
            self.closed = True
            self.post(kind, payload)


def bad_request(e: UnmaskError, options: dict) -> ApiError:
    """A 400 for a decoder's own validation error, ``param`` the knob the message names first
    (:func:`~unmask.serve.protocol.named_param`)."""
    message = api_message(str(e).splitlines()[0])
    return ApiError(400, message, param=named_param(message, options))


def finish_gone(job: Job) -> None:
    """Answer a cancelled (no payload) or timed-out (408) request."""
    if job.cancelled.is_set():
        job.finish("cancelled", None)
    else:
        job.finish("error", timed_out())


def timed_out() -> ApiError:
    return ApiError(408, "the request timed out; raise 'timeout' or lower max_tokens", type="timeout_error",
                    code="timeout")


def server_error() -> ApiError:
    return ApiError(500, "internal error while decoding; see the server log", type="server_error")


def shutting_down(retry_after: bool = True) -> ApiError:
    """The 503 of a draining server: new requests get Retry-After; the requests it ends do not."""
    return ApiError(503, "the server is shutting down; retry later", type="server_error",
                    headers={"Retry-After": "1"} if retry_after else None)


class QueueFull(Exception):
    """The bounded queue is full (HTTP 429)."""


class ShuttingDown(Exception):
    """The scheduler is draining for shutdown and admits nothing (HTTP 503)."""
