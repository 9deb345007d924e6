"""Draft sizing under load (issue 16): the draft-size table, and the scheduler picking lossless
SBD's block size K from the running batch, down to plain AR steps, without changing any output."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from unmask.errors import UnmaskError
from unmask.serve.draft_sizing import DEFAULT, DraftSizes, draft_sizes_option


def test_table_picks_the_last_step_at_or_below_the_rows():
    t = DraftSizes.parse("1:8, 2:4,4:1")
    assert t.steps == ((1, 8), (2, 4), (4, 1))
    assert [t.size(n) for n in (1, 2, 3, 4, 5, 200)] == [8, 4, 4, 1, 1, 1]
    assert DraftSizes.parse("1:6").size(1000) == 6
    assert draft_sizes_option("off") is None and draft_sizes_option(None) is None
    assert draft_sizes_option(t) is t and draft_sizes_option("1:8,2:4,4:1") == t
    assert draft_sizes_option("auto") == DEFAULT == "auto"


def test_the_auto_table_runs_the_served_layout_then_the_smallest_stored_one_then_ar():
    """``auto`` (the default): a budgeted layout below SMALL_ROWS rows, the smallest stored layout
    (its K = D + 1) below AR_ROWS, then K = 1; linear drafts the linear table; an explicit table as given."""
    from unmask.serve.draft_sizing import AR_ROWS, LINEAR_TEXT, SMALL_ROWS, smaller_layouts, table_for

    stored = {"draft_layouts": "8=3/3/4 16=4/0,4/5 24=5/0,2,5/6"}
    assert smaller_layouts("5/0,2,5/6", stored) == ("3/3/4", "4/0,4/5")
    assert smaller_layouts("4/0,4/5", stored) == ("3/3/4",) and smaller_layouts("linear", stored) == ()
    t = table_for("auto", "4/0,4/5", stored)
    assert t.steps == ((1, 5), (SMALL_ROWS, 4), (AR_ROWS, 1))
    assert table_for("auto", "linear", stored) == DraftSizes.parse(LINEAR_TEXT)
    assert table_for("auto", "3/3/4", stored) == DraftSizes.parse(LINEAR_TEXT)  # nothing smaller stored
    fixed = DraftSizes.parse("1:3,2:1")
    assert table_for(fixed, "4/0,4/5", stored) is fixed and table_for(None, "4/0,4/5", stored) is None


@pytest.mark.parametrize("text, needle", [("", "bad draft-size entry"), ("8", "bad draft-size entry"),
                                          ("1:x", "bad draft-size entry"), ("2:8", "start at 1 row"),
                                          ("1:8,4:4,2:1", "must increase"), ("1:8,2:0", ">= 1")])
def test_bad_tables_are_one_line_errors(text, needle):
    with pytest.raises(UnmaskError) as e:
        DraftSizes.parse(text)
    assert needle in str(e.value) and "\n" not in str(e.value)


pytest.importorskip("fastapi", reason="the scheduler tests need the serve extra: pip install -e '.[test]'")

import unmask  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

from test_serve import MODEL, PROMPTS, post, wait_until  # noqa: E402


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


def _run(bundle, bodies, **app_kwargs):
    """Queue every body while the scheduler is paused, release them at once; (texts, draft_log)."""
    app = create_app(bundle, max_batch_size=8, max_queue=16, **app_kwargs)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        sched.pause()
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(post, s.url + "/v1/completions", b) for b in bodies]
            wait_until(lambda: sched.queue_depth == len(bodies))
            sched.resume()
            answers = [f.result() for f in futures]
        wait_until(lambda: sched.active == 0)
    assert all(status == 200 for status, _, _ in answers)
    return [r["choices"][0]["text"] for _, _, r in answers], list(sched.draft_log)


@pytest.mark.parametrize("rows, expect_k", [(1, 8), (2, 4), (5, 1)])
def test_the_load_sets_k_and_the_output_stays_ar_s(bundle, rows, expect_k):
    """Greedy lossless sbd requests that fix no block size: K from the table at the load they join
    (5 rows: K = 1, AR steps), chosen again as rows leave; every text equals unmask.generate's (and AR's)."""
    bodies = [{"prompt": PROMPTS[i], "max_tokens": 24, "decoder": "sbd"} for i in range(rows)]
    texts, log = _run(bundle, bodies, draft_sizes="1:8,2:4,4:1")
    assert log and log[0] == (rows, expect_k)
    assert all(k == {1: 8, 2: 4, 3: 4}.get(n, 1) for n, k in log)  # every later K is the table's at its load
    for p, t in zip(PROMPTS, texts):
        assert t == unmask.generate(p, bundle, "ar", max_new_tokens=24).texts[0]
        assert t == unmask.generate(p, bundle, "sbd", max_new_tokens=24).texts[0]


def test_a_fixed_block_size_or_sizing_off_is_left_alone(bundle):
    bodies = [{"prompt": PROMPTS[i], "max_tokens": 16, "decoder": "sbd", "block_size": 4} for i in range(5)]
    texts, log = _run(bundle, bodies)
    assert log == []  # the request fixed K
    plain = [{k: v for k, v in b.items() if k != "block_size"} for b in bodies]
    texts_off, log_off = _run(bundle, plain, draft_sizes="off")
    assert log_off == [] and texts_off == texts
    for p, t in zip(PROMPTS, texts):
        assert t == unmask.generate(p, bundle, "ar", max_new_tokens=16).texts[0]


def test_lossy_and_sampled_requests_are_never_sized(bundle):
    bodies = [{"prompt": PROMPTS[i], "max_tokens": 12, "decoder": "sbd", "gamma": 0.35} for i in range(4)]
    bodies += [{"prompt": PROMPTS[0], "max_tokens": 12, "decoder": "sbd", "temperature": 1.0, "seed": 3}]
    _, log = _run(bundle, bodies)
    assert log == []


def test_the_scheduler_parses_a_text_table(bundle):
    """Found by the fault pass: Scheduler(draft_sizes="off" / "AUTO" / "1:4") kept the text, and its first
    sized step failed (the request never answered)."""
    from unmask.serve.engine import Scheduler

    assert Scheduler(bundle, draft_sizes="off").draft_sizes is None
    assert Scheduler(bundle, draft_sizes=" AUTO ").draft_sizes == "auto"
    assert Scheduler(bundle, draft_sizes="1:4,2:1").draft_sizes == DraftSizes.parse("1:4,2:1")


def test_auto_or_off_on_a_model_without_lossless_sbd_is_no_error(monkeypatch):
    """Found by the fault pass: the documented default, passed explicitly, was refused on a model that
    does not run lossless sbd; an explicit table still is."""
    from unmask.serve import server

    started = []

    def create_app(*args, **kwargs):  # records the table it was given, then stops before serving
        started.append(kwargs["draft_sizes"])
        raise SystemExit(0)

    monkeypatch.setattr(server, "create_app", create_app)
    for value in ("auto", "off"):
        with pytest.raises(SystemExit):
            server.serve("stories260K", draft_sizes=value, port=0)
    assert started == ["auto", None]
    with pytest.raises(UnmaskError, match="--draft-sizes applies to lossless sbd"):
        server.serve("stories260K", draft_sizes="1:4", port=0)


def test_serve_cli_refuses_a_bad_table_in_one_line(capsys):
    from unmask.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--draft-sizes", "1:8,2", "--port", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: bad draft-size entry '2'") and err.count("\n") == 1


def test_a_request_arriving_during_a_running_batch_joins_it_at_once(bundle):
    """A long sized sbd request runs (K from an idle server's table); a greedy lossless sbd request
    that arrives meanwhile joins the same running batch at the next step, with the same text as
    alone, and both rows take the table's K at the new load."""
    import openai

    app = create_app(bundle, max_batch_size=4, max_queue=8)
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        long = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                    extra_body={"decoder": "sbd"})
        next(iter(long))
        K = sched.ar.cfg.block_size  # the auto table: the served layout's own K at 1 and 2 rows
        assert len(sched.ar) == 1 and sched.draft_log[-1] == (1, K)
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=16, extra_body={"decoder": "sbd"})
        assert r.choices[0].text == unmask.generate(PROMPTS[1], bundle, "sbd", max_new_tokens=16).texts[0]
        assert (2, K) in sched.draft_log and sched.peak_running == 2  # one batch, the default table's K at 2 rows
        long.close()
        wait_until(lambda: sched.active == 0)


def test_a_draft_size_the_model_cannot_decode_is_refused_at_startup(bundle):
    """Found by the fault pass: --draft-sizes 1:99999 started, then failed every greedy sbd request."""
    with pytest.raises(UnmaskError, match=r"--draft-sizes: K = 99999 cannot decode on .*lower the table's largest K"):
        create_app(bundle, draft_sizes="1:99999")


def test_a_client_gone_before_its_body_arrived_is_no_server_error(bundle):
    """Found by the fault pass: a ClientDisconnect while reading the body logged an ASGI traceback."""
    import socket
    import urllib.request

    app = create_app(bundle)
    with ServerThread(app) as s:
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        time.sleep(0.5)
        health = json.loads(urllib.request.urlopen(s.url + "/health", timeout=10).read())
        assert health["status"] == "ok"
        metrics = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
        assert 'outcome="cancelled"' in metrics


def test_a_sized_sbd_row_steps_at_k_1_while_ar_rows_push_the_load_past_the_crossover(bundle):
    """A greedy lossless sbd request alone on an idle server drafts (K > 1); once an AR row runs
    beside it and the load is past the table's crossover, the same row takes K = 1 (plain AR steps)
    at the next step, without moving anywhere, and drafts again when the AR row has left: same text
    and stream as AR's, NFE below one forward per token."""
    import openai

    # the crossover at 2 rows: one AR row beside the sbd one is past it (the default table's is at 6)
    app = create_app(bundle, max_batch_size=4, max_queue=8, draft_sizes="1:4,2:1")
    gen = unmask.generate(PROMPTS[0], bundle, "ar", max_new_tokens=300)
    ref = gen.texts[0]
    with ServerThread(app) as s:
        sched = app.state.scheduler
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=300, stream=True,
                                      extra_body={"decoder": "sbd"})
        chunks = [next(iter(stream))]
        assert sched.draft_log[-1] == (1, 4)  # K from an idle server
        r = c.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=48, extra_body={"decoder": "ar"})
        chunks += list(stream)
        log = sched.draft_log
        assert (2, 1) in log and log.index((2, 1)) < len(log) - 1 and log[-1] == (1, 4)
        assert "".join(x.choices[0].text for x in chunks) == ref
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(gen.tokens[0])
        # how far the sbd batch got before the AR row started is timing; it never costs more than AR
        assert 1 <= usage.model_extra["nfe"] <= usage.completion_tokens
        assert r.choices[0].text == unmask.generate(PROMPTS[1], bundle, "ar", max_new_tokens=48).texts[0]
        wait_until(lambda: sched.active == 0)


def test_auto_on_a_compiled_server_runs_the_smallest_stored_layout_then_ar_steps():
    from unmask.serve.draft_sizing import COMPILED_AR_ROWS, LINEAR_TEXT, table_for

    stored = {"draft_layouts": "8=3/3/4 16=4/0,4/5"}
    assert table_for("auto", "4/0,4/5", stored, compiled=True).steps == ((1, 4), (COMPILED_AR_ROWS, 1))
    assert table_for("auto", "3/3/4", stored, compiled=True).steps == ((1, 4), (COMPILED_AR_ROWS, 1))
    assert table_for("auto", "linear", stored, compiled=True) == DraftSizes.parse(LINEAR_TEXT)
    fixed = DraftSizes.parse("1:5,2:1")
    assert table_for(fixed, "4/0,4/5", stored, compiled=True) is fixed


def test_a_compiled_scheduler_sizes_drafts_by_the_compiled_table(bundle):
    from unmask.serve.draft_sizing import COMPILED_AR_ROWS
    from unmask.serve.engine import Scheduler

    compiled, eager = Scheduler(bundle, compile=True).sizer, Scheduler(bundle).sizer
    draft = "4/0,4/5"
    assert compiled.compiled and not eager.compiled
    assert [compiled.size(draft, n, True, None) for n in (1, COMPILED_AR_ROWS - 1, COMPILED_AR_ROWS)] == [4, 4, 1]
    assert [eager.size(draft, n, True, None) for n in (1, COMPILED_AR_ROWS)] == [5, 4]
