"""Roofline model: every SBD §7.6 reference cell (paper mode) and corrected-mode sanity."""

import json

import pytest

from unmask.bench.roofline import (
    TABLE3_KV,
    GPUSpec,
    ModelShape,
    Precision,
    roofline,
    slowdown_table,
    speedup_table,
)
from unmask.errors import UnmaskError


@pytest.fixture(scope="module")
def table3():
    return slowdown_table(mode="paper")


@pytest.fixture(scope="module")
def table4():
    return speedup_table(mode="paper")


@pytest.mark.parametrize("kv", [kv for kv in TABLE3_KV if kv <= 16384])
def test_table3_batch1_row_exact(table3, kv):
    got = [round(table3.value(batch=1, block=k, kv_length=kv), 3) for k in (1, 2, 4, 8, 16, 32, 64)]
    assert got == [1.000, 1.000, 1.001, 1.002, 1.004, 1.008, 1.015]


@pytest.mark.parametrize("kv", [16, 256, 1024])
def test_table3_batch16_block64_exact(table3, kv):
    assert round(table3.value(batch=16, block=64, kv_length=kv), 3) == 3.799


@pytest.mark.parametrize("kv", [kv for kv in TABLE3_KV if kv <= 16384])
def test_table4_batch1_block16(table4, kv):
    got = [table4.value(batch=1, block=16, nfe_speedup=s, kv_length=kv) for s in (2, 4, 8)]
    assert got == pytest.approx([1.992, 3.982, 7.955], abs=1e-3)


def test_paper_grids_have_the_paper_shape(table3, table4):
    assert table3.rows == tuple((b, k) for b in (1, 4, 8, 16) for k in (1, 2, 4, 8, 16, 32, 64))
    assert table3.kv_lengths == (2**4, 2**8, 2**10, 2**12, 2**14, 2**16, 2**20, 2**22)
    assert table4.rows == tuple((b, k, s) for b in (1, 4, 8) for k in (8, 16, 32, 64)
                                for s in (2, 4, 8))
    assert table4.kv_lengths == table3.kv_lengths
    assert len(table3.format().splitlines()) == 3 + 4 * 7
    assert len(table4.format().splitlines()) == 3 + 4 * 3 * 3


def test_paper_absolute_time_reflects_the_ffn_mistake():
    # SBD spec §7.4: one "layer" at batch 1 takes about 0.149 s.
    assert roofline(mode="paper").time(n=1, batch=1, kv_len=16) == pytest.approx(0.149, abs=5e-4)


def test_paper_jump_at_about_269_tokens():
    model = roofline(mode="paper")
    below = model.slowdown(k=268, batch=1, kv_len=16)
    above = model.slowdown(k=300, batch=1, kv_len=16)
    assert below < 1.1 < above


def test_paper_mode_rejects_shape():
    with pytest.raises(UnmaskError):
        roofline(mode="paper", shape="llama-3.1-8b")
    with pytest.raises(UnmaskError):
        roofline(mode="fast")


@pytest.fixture(scope="module")
def corrected3():
    return slowdown_table(mode="corrected", shape="llama-3.1-8b", gpu="h100-sxm")


def test_corrected_batch1_block16_is_nearly_free(corrected3):
    table4 = speedup_table(mode="corrected", batches=(1,), blocks=(16,))
    for kv in TABLE3_KV:
        assert corrected3.value(batch=1, block=16, kv_length=kv) < 1.02
        for s in (2, 4, 8):
            got = table4.value(batch=1, block=16, nfe_speedup=s, kv_length=kv)
            assert abs(got - s) / s < 0.02


def test_corrected_block64_slowdown_grows_with_kv(corrected3):
    row = [corrected3.value(batch=1, block=64, kv_length=kv) for kv in TABLE3_KV]
    # From 1,024 keys on attention dominates; at 16 vs 256 keys the two are equal to 1e-3.
    assert row[2:] == sorted(row[2:])
    assert row[-1] > row[0] + 0.5
    model = corrected3.model
    attn64, attn16 = (model.ops(n=k, batch=1, kv_len=2**22)[0] for k in (64, 16))
    ridge = model.gpu.attention_flops / model.gpu.bandwidth
    assert attn64.flops / attn64.bytes > ridge > attn16.flops / attn16.bytes


def test_from_config_matches_preset():
    cfg = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
           "vocab_size": 128256, "tie_word_embeddings": False}
    shape = ModelShape.from_config(cfg, name="llama-3.1-8b")
    assert shape == ModelShape.preset("llama-3.1-8b")
    assert 7.9e9 < shape.n_params < 8.1e9
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    assert ModelShape.from_config(hf, name="llama-3.1-8b") == shape
    with pytest.raises(UnmaskError):
        ModelShape.from_config({"hidden_size": 8})


def test_corrected_counts_every_layer_and_lm_head():
    shape = ModelShape.preset("llama-3.1-8b")
    one = ModelShape(**{**shape.__dict__, "layers": 1})
    gpu = GPUSpec("unit", 1.0e30, 1.0e30, 1.0)  # pure bandwidth: time == bytes
    t = lambda s: roofline(mode="corrected", shape=s, gpu=gpu,  # noqa: E731
                           precision=Precision(1, 1, 1)).time(n=1, batch=1, kv_len=0)
    lm_head = shape.hidden + shape.vocab * shape.hidden + shape.vocab
    assert t(shape) - lm_head == pytest.approx(32 * (t(one) - lm_head))
    assert t(shape) == pytest.approx(shape.n_params - shape.vocab * shape.hidden, rel=1e-3)


def test_presets_and_validation():
    assert GPUSpec.preset("h100-sxm-paper").bandwidth == pytest.approx(3.683e12, rel=1e-3)
    assert GPUSpec.preset("h200").bandwidth == 4.8e12
    for bad in (lambda: GPUSpec.preset("tpu"), lambda: ModelShape.preset("gpt-5"),
                lambda: Precision(weight=0), lambda: GPUSpec("x", 1, 1, 0)):
        with pytest.raises(UnmaskError):
            bad()


def test_to_dict_is_json(table3, table4):
    d3 = json.loads(json.dumps(table3.to_dict()))
    assert d3["rows"][-1]["batch"] == 16 and d3["rows"][-1]["block"] == 64
    assert d3["rows"][-1]["values"][0] == pytest.approx(3.799, abs=5e-4)
    d4 = json.loads(json.dumps(table4.to_dict()))
    assert d4["rows"][3] == {"batch": 1, "block": 16, "nfe_speedup": 2,
                             "values": pytest.approx([1.992] * 6 + [1.992, 1.992], abs=1e-3)}
    with pytest.raises(UnmaskError):
        table3.value(batch=2, block=1, kv_length=16)


def test_plot_writes_png(tmp_path, table3, table4):
    pytest.importorskip("matplotlib")
    table3.plot(str(tmp_path / "t3.png"))
    table4.plot(str(tmp_path / "t4.png"))
    assert (tmp_path / "t3.png").stat().st_size > 0 and (tmp_path / "t4.png").stat().st_size > 0
