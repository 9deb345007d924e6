"""Found by the round-7 fault pass: a lossless layout's step tables are bounded before they are
built (a long layout asked the CLI and the server for gigabytes), the server keeps at most
MAX_LAYOUTS layout batches, refuses to start when its own defaults break its limits, and
calibrate-drafts names a fix that exists when it cannot store its table."""

from __future__ import annotations

import pytest
from conftest import one_line_error

import unmask
from unmask.decode.verify import config as vconfig
from unmask.decode.verify import tree as tv
from unmask.errors import UnmaskError


@pytest.mark.parametrize("draft,K", [("linear", 8), ("quadratic", 5), ("3/0,2,3/4", None), ("5/0/8+1+2", None),
                                     ("4/0,4/5+1c1g2", None)])
def test_table_bytes_is_what_tree_window_allocates(draft, K):
    cfg = vconfig.VerifyConfig.of(block_size=K or 8, draft=draft)
    fam = vconfig.family(cfg.draft, cfg.block_size)
    tw = tv.tree_window(fam)
    real = sum(t.numel() * t.element_size() for t in (tw.mask, tw.offsets, tw.tok, tw.path, tw.path_len, tw.src,
                                                       tw.length, tw.sib_offset, tw.sib_rank))
    assert tv.table_bytes(fam) == real


@pytest.mark.parametrize("draft,K", [("60/0/400", None), ("quadratic", 32), ("62/0/2+1+2+3+4+5+6+7+8+9+10", None)])
def test_a_layout_whose_tables_pass_the_limit_is_refused_before_they_exist(draft, K):
    cfg = vconfig.VerifyConfig.of(block_size=K or 8, draft=draft)  # the layout itself is valid text
    with pytest.raises(UnmaskError, match=r"MiB of step tables, more than the 256 MiB allowed; use fewer"):
        cfg.check_fits(10**6)  # a context window the layout fits: its tables are what is too large


def test_the_cli_refuses_a_huge_layout_in_one_line(capsys):
    one_line_error(capsys, "generate", "Once upon a time", "--decoder", "sbd", "--verify", "--draft", "60/0/400",
                   "-n", "4", match="MiB of step tables")


def test_linear_64_the_largest_block_size_still_fits():
    assert tv.table_bytes(vconfig.family("linear", 64)) <= vconfig.MAX_TABLE_MIB * 2**20


def test_calibrate_drafts_names_a_fix_it_has_when_it_cannot_store(tmp_path, capsys, monkeypatch):
    import shutil

    from unmask.models.registry import shipped
    from unmask.train import wiring

    model = tmp_path / "sbd"
    shutil.copytree(shipped()["stories260K-sbd"], model)
    (tmp_path / "p.txt").write_text("Once upon a time\n")

    def refuse(target, **defaults):
        raise UnmaskError(f"cannot write file {target}/unmask_config.json: Operation not permitted; choose a writable path")

    monkeypatch.setattr(wiring, "set_decode_defaults", refuse)
    msg = one_line_error(capsys, "calibrate-drafts", model, "--prompts", tmp_path / "p.txt", "-n", "8", "--budgets", "8",
                         match="Operation not permitted")
    assert "copy the model to a writable directory" in msg and "--dry-run" in msg and "writable path" not in msg


serve = pytest.importorskip("unmask.serve", reason="the server tests need the serve extra")
for _m in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(_m, reason=f"the server tests need {_m}: pip install -e '.[test]'")


@pytest.fixture(scope="module")
def bundle():
    return unmask.load("stories260K-sbd")


def test_a_server_whose_default_requests_break_its_limits_does_not_start(bundle):
    from unmask.serve.limits import Limits

    with pytest.raises(UnmaskError, match="every default request would be refused: this request puts 15 query tokens"):
        serve.create_app(bundle, defaults={"draft": "4/0,4/5"}, limits=Limits(max_query_tokens=10))
    serve.create_app(bundle, defaults={"draft": "4/0,4/5"}, limits=Limits(max_query_tokens=15))  # fits: starts


def test_cli_serve_refuses_a_draft_over_its_query_limit(capsys):
    one_line_error(capsys, "serve", "--draft", "4/0,4/5", "--max-query-tokens", "10", "--port", "0",
                   match="every default request would be refused")


def test_the_server_keeps_at_most_max_layouts_layout_batches(bundle, monkeypatch):
    import json
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    from unmask.serve import batches
    from unmask.serve.server import ServerThread

    monkeypatch.setattr(batches, "MAX_LAYOUTS", 2)  # the default's batch and one other
    layouts = ["3/3/4", "2/0/5", "3/1,3/4", "3/0,2,3/4"]
    prompt = "Once upon a time"
    ref = unmask.generate(prompt, bundle, "ar", max_new_tokens=12).texts[0]
    app = serve.create_app(bundle, max_batch_size=4)
    sched = app.state.scheduler
    default = sched.ar.cfg.draft
    assert default not in layouts

    def ask(draft):
        body = {"prompt": prompt, "max_tokens": 12, "decoder": "sbd", "verify": True, "draft": draft}
        req = urllib.request.Request(s.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    with ServerThread(app) as s:
        for draft in layouts:  # one after another: each new layout replaces the idle one
            assert ask(draft) == ref
            assert set(sched.verify) == {default, draft}
        with ThreadPoolExecutor(len(layouts)) as pool:  # together: new layouts wait for a batch to go idle
            assert list(pool.map(ask, layouts)) == [ref] * len(layouts)
        assert len(sched.verify) <= 2 and default in sched.verify and sched.active == 0
