"""HostRead: a step's named columns packed into one tensor, read with one tolist(), unpacked by name."""

import pytest
import torch

from unmask.decode.engine.host import HostRead


def test_each_column_reads_back_as_its_own_tolist():
    g = torch.Generator().manual_seed(0)
    R = 5
    cols = {"count": torch.randint(0, 9, (R,), generator=g),
            "flag": torch.rand(R, generator=g) > 0.5,
            "small": torch.randint(-3, 3, (R,), generator=g, dtype=torch.int32),
            "ids": torch.randint(0, 1000, (R, 4), generator=g),
            "none": torch.zeros(R, 0, dtype=torch.long),
            "grid": torch.randint(0, 7, (R, 2, 3), generator=g, dtype=torch.int16)}
    read = HostRead()
    for name, t in cols.items():
        assert read.add(name, t) is read
    got = read.read()
    assert list(got) == list(cols)
    for name, t in cols.items():
        want = t.reshape(R, -1).long().tolist() if t.dim() > 1 else t.long().tolist()
        assert got[name] == want, name
        assert all(type(v) is int for v in (got[name] if t.dim() == 1 else sum(got[name], [])))


def test_bool_columns_alone_read_as_ints():
    got = HostRead().add("ended", torch.tensor([True, False])).add("keep", torch.tensor([[False], [True]])).read()
    assert got == {"ended": [1, 0], "keep": [[0], [1]]}
    assert all(type(v) is int for v in got["ended"] + sum(got["keep"], []))


def test_no_rows_and_no_columns():
    assert HostRead().read() == {}
    got = HostRead().add("a", torch.zeros(0, dtype=torch.long)).add("b", torch.zeros(0, 3, dtype=torch.bool)).read()
    assert got == {"a": [], "b": []}


def test_floats_and_ragged_rows_are_refused():
    with pytest.raises(ValueError, match="'x' is torch.float32"):
        HostRead().add("x", torch.zeros(3))
    with pytest.raises(ValueError, match="'b' has 2 rows, the others 3"):
        HostRead().add("a", torch.zeros(3, dtype=torch.long)).add("b", torch.zeros(2, dtype=torch.long))
