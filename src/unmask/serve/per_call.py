"""What still runs per call in the server: one ``decode`` over a batch of compatible queued requests
(a remote-code LLaDA, whose forward takes no positions, so its rows cannot share a padded batch).
While such a batch runs, the scheduler's running decoders admit and step after each of its forwards;
a row whose committed prefix fixes its answer is answered at once, and the batch stops when none of
its requests is still wanted. Functions of the :class:`~unmask.serve.engine.Scheduler` (``sched``),
run on its thread."""

from __future__ import annotations

import logging

from unmask.decode import spec_for
from unmask.decode.engine.stop import StopRule
from unmask.errors import UnmaskError
from unmask.serve.jobs import bad_request, finish_gone, server_error
from unmask.serve.stream import edits_committed

log = logging.getLogger("unmask.serve")


class _Abandoned(Exception):
    """Raised from ``on_step`` to stop a per-call batch none of whose requests is still wanted."""


def final(sched, job, canvas: list) -> tuple[list[int], str, int] | None:
    """(tokens, finish reason, 1 when it ended on a stop token else 0) when a row's committed canvas
    already fixes its answer: the committed prefix reaches a stop token, ``max_new_tokens`` or a stop string."""
    tokens = []
    for t in canvas[: job.max_new_tokens]:
        if t is None:
            return None
        if t in sched.stop_ids:
            return tokens, "stop", 1
        tokens.append(t)
    if stopped(sched.bundle, job, tokens):  # before the length: a canvas may commit all max_new_tokens at once
        return tokens, "stop", 0
    if len(tokens) >= job.max_new_tokens:
        return tokens, "length", 0
    return None


def stopped(bundle, job, tokens: list[int]) -> bool:
    """Whether the text of ``tokens`` holds one of the job's stop strings (the answer is cut there)."""
    return StopRule.of(strings=job.stop).hit(bundle, job.prompt_ids, tokens)


def run_batch(sched, jobs: list) -> None:
    """Decode ``jobs`` in one call of their decoder and answer each (see the module docstring)."""
    first = jobs[0]
    sched._batch = jobs
    sched.peak_running = max(sched.peak_running, sched.active)
    last_step, steps = [None], [0] * len(jobs)  # forwards in which each row had work (its step events)
    edits = edits_committed(sched.bundle, first.decoder, first.options)

    def on_step(event: dict) -> None:
        if event["step"] != last_step[0]:  # a new forward of the batch: the running decoders admit and step too
            last_step[0] = event["step"]
            with sched._lock:
                sched._reap_waiting()
                joining = sched._take_running()
            sched._advance(joining)
        row = int(event["row"])
        job = jobs[row]
        if job.gone:
            finish_gone(job)
        elif not job.closed:
            job.post("step", event)
            steps[row] += 1
            # logprobs come with the decode's output: such a row is answered when the batch ends
            answer = None if edits or job.logprobs is not None else final(sched, job, event["canvas"])
            if answer is not None:  # the answer cannot change any more: send it now
                job.finish("done", {"tokens": answer[0], "nfe": steps[row], "finish_reason": answer[1],
                                    "stop_token": answer[2]})
        if all(j.gone or j.closed for j in jobs):
            raise _Abandoned

    kwargs = {**first.options, "on_step": on_step, **({"compile": True} if sched.compile else {}),
              "logprobs": first.logprobs, "logit_bias": first.logit_bias}  # equal in a batch (Job.batch_key)
    try:
        out = spec_for(first.decoder, sched.bundle.kind).decode(
            sched.bundle, [j.prompt_ids for j in jobs], max_new_tokens=first.max_new_tokens, sampling=first.sampling,
            stop_token_ids=sched.bundle.stop_token_ids, stop_strings=first.stop, **kwargs)
    except _Abandoned:
        sched.abandoned_batches += 1
        for j in jobs:
            finish_gone(j)
        return
    except UnmaskError as e:  # the decoder's own validation (block size, policy, ...): a bad request
        for j in jobs:
            j.finish("error", bad_request(e, first.options))
        return
    except Exception:  # a bug fails this batch only; the running batches and the queue keep going
        log.exception("decoding a %s batch failed", first.decoder)
        for j in jobs:
            j.finish("error", server_error())
        return
    finally:
        sched._batch = []
    for i, j in enumerate(jobs):
        if j.gone:
            finish_gone(j)
            continue
        toks = out.tokens[i]
        reason = "length" if len(toks) >= j.max_new_tokens and not stopped(sched.bundle, j, toks) else "stop"
        j.finish("done", {"tokens": toks, "nfe": int(out.stats.nfe_per_row[i]), "finish_reason": reason,
                          "stop_token": out.stats.row(i)["stop_token"],
                          **({} if out.logprobs is None else {"logprobs": out.logprobs[i]})})
