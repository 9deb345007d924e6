"""``unmask serve --draft / --queries``: the server's lossless layout, the batch AR and lossless rows
join, and one-line errors for bad values (issue 26)."""

from __future__ import annotations

import pytest

for _m in ("fastapi", "uvicorn", "prometheus_client", "openai"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")

from conftest import one_line_error, run_cli  # noqa: E402

import unmask  # noqa: E402
from unmask.decode.verify import layout as dl  # noqa: E402
from unmask.errors import UnmaskError  # noqa: E402
from unmask.serve import create_app  # noqa: E402
from unmask.serve.server import ServerThread  # noqa: E402

MODEL = "stories260K-sbd"


@pytest.fixture(scope="module")
def bundle():
    return unmask.load(MODEL)


def test_server_draft_sets_the_layout_ar_and_lossless_rows_join(bundle):
    import openai

    want = dl.resolve("budget", 24, bundle.meta["decode_defaults"])
    assert want != dl.resolve("budget", None, bundle.meta["decode_defaults"])  # not the checkpoint's default
    before = dict(bundle.meta["decode_defaults"])
    # draft sizes off: the row keeps the layout's own K, so its forwards equal a decode alone
    app = create_app(bundle, defaults={"draft": "budget", "queries": 24}, max_batch_size=4, draft_sizes="off")
    sched = app.state.scheduler
    assert sched.ar.cfg.draft == want and bundle.meta["decode_defaults"] == before  # the caller's bundle unchanged
    with ServerThread(app) as s:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, extra_body={"decoder": "sbd"})
        alone = unmask.generate("Once upon a time", bundle, "sbd", max_new_tokens=24, draft="budget", queries=24)
        assert r.choices[0].text == alone.texts[0] and r.usage.model_extra["nfe"] == alone.stats.nfe
        ar = c.completions.create(model=MODEL, prompt="Zoo", max_tokens=8, extra_body={"decoder": "ar"})
        assert ar.choices[0].text == unmask.generate("Zoo", bundle, "ar", max_new_tokens=8).texts[0]
        assert list(sched.verify) == [want]  # one batch: the server's layout, for AR and lossless rows alike
        # a request's own draft still wins, in a batch of its layout
        c.completions.create(model=MODEL, prompt="Zoo", max_tokens=8,
                             extra_body={"decoder": "sbd", "draft": "budget", "queries": 8})
        assert set(sched.verify) == {want, dl.resolve("budget", 8, bundle.meta["decode_defaults"])}


def test_server_draft_linear_needs_no_queries(bundle):
    app = create_app(bundle, defaults={"draft": "linear"})
    assert app.state.scheduler.ar.cfg.draft == "linear"
    assert app.state.bundle.meta["decode_defaults"]["draft"] == "linear"


def test_server_queries_alone_mean_the_budgeted_draft(bundle):
    """``serve --queries Q`` is ``--draft budget --queries Q``, as for ``unmask generate`` (it was refused)."""
    alone, budget = create_app(bundle, defaults={"queries": 24}), create_app(bundle, defaults={"draft": "budget", "queries": 24})
    want = dl.resolve("budget", 24, bundle.meta["decode_defaults"])
    assert alone.state.scheduler.ar.cfg.draft == budget.state.scheduler.ar.cfg.draft == want
    assert alone.state.bundle.meta["decode_defaults"] == budget.state.bundle.meta["decode_defaults"]


@pytest.mark.parametrize("defaults, match", [
    ({"draft": "linear", "queries": 24}, "--queries applies to --draft budget"),
    ({"draft": "budget", "queries": 2}, "a query budget must be an integer >= 4"),
    ({"draft": "nope"}, "unknown draft layout 'nope'"),
    ({"draft": "3/0,9/4"}, "bad draft layout"),
])
def test_bad_server_draft_values_are_one_line_errors(bundle, defaults, match):
    with pytest.raises(UnmaskError, match=match) as e:
        create_app(bundle, defaults=defaults)
    assert "\n" not in str(e.value) and ";" in str(e.value)


def test_server_draft_on_a_model_without_lossless_sbd_is_refused():
    with pytest.raises(UnmaskError, match=r"--draft applies to lossless sbd, which stories260K \(causal\)"):
        create_app(unmask.load("stories260K"), defaults={"draft": "linear"})


def test_cli_serve_checks_draft_and_queries_before_loading(capsys):
    one_line_error(capsys, "serve", "--queries", "3", "--port", "0", match="integer >= 4")
    one_line_error(capsys, "serve", "--draft", "budget", "--queries", "3", "--port", "0", match="--queries 16")
    one_line_error(capsys, "serve", "--draft", "budget:x", "--port", "0", match="budget:16")
    one_line_error(capsys, "serve", "-m", "stories260K", "--draft", "linear", "--port", "0",
                   match="--draft applies to lossless sbd")
    code, out, _ = run_cli(capsys, "serve", "--help")
    assert code == 0 and "--draft" in out and "--queries" in out
