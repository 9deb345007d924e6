"""llama2.c conversion (spec/models.md §1): the golden reference check, an independent float64
re-implementation of run.c's forward, the convert → plain-transformers round trip, and every
corrupt-input path."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STORIES_DIR, llama2c_decode

import unmask
from unmask.errors import UnmaskError
from unmask.models import llama2c

BIN = STORIES_DIR / "stories260K.bin"
TOK = STORIES_DIR / "tok512.bin"
GOLDEN_IDS = [1, 410, 469, 347]
GOLDEN_TEXT = ("Zoo was a little girl named Lily. She loved to play outside in the park. One day, she saw a big, "
               "red ball. She wanted to play with it, but she didn't want to play")

pytestmark = pytest.mark.skipif(not BIN.is_file(), reason=f"{BIN} not found; set UNMASK_DATA_DIR")


# --- an independent llama2.c (run.c) forward in float64 --------------------------------------


def read_run_c_weights(path: Path) -> tuple[dict, dict]:
    """Parse a legacy v0 .bin with struct/numpy only (no unmask code): (config, float64 weights)."""
    raw = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack_from("<7i", raw, 0)
    cfg = dict(dim=dim, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv=n_kv, vocab=abs(vocab), seq_len=seq_len)
    body = np.frombuffer(raw, dtype="<f4", offset=28).astype(np.float64)
    hs = dim // n_heads
    kv_dim = n_kv * hs
    w, off = {}, 0
    for name, shape in [("emb", (abs(vocab), dim)), ("rms_att", (n_layers, dim)), ("wq", (n_layers, dim, dim)),
                        ("wk", (n_layers, kv_dim, dim)), ("wv", (n_layers, kv_dim, dim)), ("wo", (n_layers, dim, dim)),
                        ("rms_ffn", (n_layers, dim)), ("w1", (n_layers, hidden, dim)), ("w2", (n_layers, dim, hidden)),
                        ("w3", (n_layers, hidden, dim)), ("rms_final", (dim,)),
                        ("freq_real", (seq_len, hs // 2)), ("freq_imag", (seq_len, hs // 2))]:
        n = int(np.prod(shape))
        w[name] = body[off: off + n].reshape(shape)
        off += n
    assert off == body.size  # shared classifier: nothing follows the frequency tables
    return cfg, w


def _rmsnorm(x, weight):
    return x * weight / np.sqrt(np.mean(x * x) + 1e-5)


class RunC:
    """run.c's ``forward``: one position per call, with a KV cache, in float64.

    RoPE rotates adjacent pairs (2j, 2j+1) of each head with freq 10000^(-2j/hs); query head h
    reads KV head h // (n_heads / n_kv).
    """

    def __init__(self, cfg: dict, w: dict):
        self.cfg, self.w = cfg, w
        L, T, nkv, hs = cfg["n_layers"], cfg["seq_len"], cfg["n_kv"], cfg["dim"] // cfg["n_heads"]
        self.k_cache = np.zeros((L, T, nkv, hs))  # (L, T, n_kv, hs)
        self.v_cache = np.zeros((L, T, nkv, hs))
        self.freq = 10000.0 ** (-np.arange(0, hs, 2) / hs)  # (hs/2,)
        self.pos = 0

    def step(self, token: int) -> np.ndarray:
        """Logits (V,) for the next token after ``token`` at the current position."""
        cfg, w, pos = self.cfg, self.w, self.pos
        dim, nh, nkv = cfg["dim"], cfg["n_heads"], cfg["n_kv"]
        hs, kv_mul = dim // nh, nh // nkv
        cos, sin = np.cos(pos * self.freq), np.sin(pos * self.freq)

        def rope(v):  # (heads, hs): rotate each adjacent pair (v0, v1)
            v0, v1 = v[:, 0::2], v[:, 1::2]  # (heads, hs/2)
            r = np.empty_like(v)
            r[:, 0::2] = v0 * cos - v1 * sin
            r[:, 1::2] = v0 * sin + v1 * cos
            return r

        x = w["emb"][token].copy()
        for l in range(cfg["n_layers"]):
            xb = _rmsnorm(x, w["rms_att"][l])
            q = rope((w["wq"][l] @ xb).reshape(nh, hs))
            self.k_cache[l, pos] = rope((w["wk"][l] @ xb).reshape(nkv, hs))
            self.v_cache[l, pos] = (w["wv"][l] @ xb).reshape(nkv, hs)
            att_out = np.zeros((nh, hs))
            for h in range(nh):
                keys = self.k_cache[l, : pos + 1, h // kv_mul]  # (pos+1, hs)
                scores = keys @ q[h] / np.sqrt(hs)
                p = np.exp(scores - scores.max())
                att_out[h] = (p / p.sum()) @ self.v_cache[l, : pos + 1, h // kv_mul]
            x = x + w["wo"][l] @ att_out.reshape(dim)
            xb = _rmsnorm(x, w["rms_ffn"][l])
            h1, h3 = w["w1"][l] @ xb, w["w3"][l] @ xb
            x = x + w["w2"][l] @ (h1 / (1.0 + np.exp(-h1)) * h3)
        self.pos += 1
        return w["emb"] @ _rmsnorm(x, w["rms_final"])


def run_c_logits(cfg: dict, w: dict, tokens: list[int]) -> np.ndarray:
    """Logits (T, V) of every position of ``tokens``."""
    run = RunC(cfg, w)
    return np.stack([run.step(t) for t in tokens])


def run_c_greedy(cfg: dict, w: dict, prompt: list[int], n: int) -> list[int]:
    """llama2.c ``generate`` with argmax sampling: n new tokens after ``prompt``."""
    run = RunC(cfg, w)
    for t in prompt[:-1]:
        run.step(t)
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(np.argmax(run.step(ids[-1]))))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def ref():
    return read_run_c_weights(BIN)


@pytest.fixture(scope="module")
def golden_tokens(ref):
    """The 56 greedy tokens of the float64 run.c reference after "Zoo"."""
    return run_c_greedy(*ref, GOLDEN_IDS, 56)


@pytest.fixture(scope="module")
def built():
    """A LlamaForCausalLM built in memory from the data-directory .bin."""
    header, tensors = llama2c.read_checkpoint(BIN)
    return llama2c.build_hf_model(header, tensors)


# --- the golden check (§1.6) ------------------------------------------------------------------


def test_golden_through_generate(stories):
    out = unmask.generate("Zoo", model=stories, decoder="ar", max_new_tokens=56)
    assert out.prompt_tokens == [GOLDEN_IDS]
    assert len(out.tokens[0]) == 56
    assert "Zoo" + out.texts[0] == GOLDEN_TEXT


def test_golden_through_run_c_reference(golden_tokens):
    pieces, _ = llama2c.read_tokenizer(TOK)
    assert llama2c_decode(pieces, GOLDEN_IDS[1:] + golden_tokens) == GOLDEN_TEXT  # ids after BOS


def test_generate_matches_run_c_tokens(stories, golden_tokens):
    out = unmask.generate("Zoo", model=stories, max_new_tokens=56)
    assert out.tokens[0] == golden_tokens


def test_native_loader_matches_run_c_tokens(built, golden_tokens):
    ids = torch.tensor([GOLDEN_IDS])
    with torch.no_grad():
        for _ in range(56):
            ids = torch.cat([ids, built(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert ids[0, 4:].tolist() == golden_tokens


# --- logits against the independent forward -----------------------------------------------------


def _hf_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def sequence(golden_tokens):
    return GOLDEN_IDS + golden_tokens  # 60 positions


@pytest.fixture(scope="module")
def ref_logits(ref, sequence):
    return run_c_logits(*ref, sequence)


def test_hf_logits_match_run_c(stories, built, ref_logits, sequence):
    for model in (stories.model, built):
        np.testing.assert_allclose(_hf_logits(model, sequence), ref_logits, atol=1e-4, rtol=0)


def test_missing_rotary_permutation_is_caught(monkeypatch, ref_logits, sequence):
    monkeypatch.setattr(llama2c, "permute_rotary", lambda w, n_heads: w)
    wrong = llama2c.build_hf_model(*llama2c.read_checkpoint(BIN))
    err = np.abs(_hf_logits(wrong, sequence) - ref_logits).max()
    assert err > 1e-2  # the test above would fail by a wide margin without the permutation


def test_permute_rotary_matches_spec_formula():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3)  # 2 heads, hd 8, d_in 3
    out = llama2c.permute_rotary(w, n_heads=2)
    # head 0: rows [0, 2, 4, 6, 1, 3, 5, 7]; head 1 the same shifted by 8
    order = [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]
    assert torch.equal(out, w[order])


def test_shipped_checkpoint_equals_fresh_conversion(stories, built):
    shipped, fresh = stories.model.state_dict(), built.state_dict()
    assert shipped.keys() == fresh.keys()
    for k in fresh:
        assert torch.equal(shipped[k], fresh[k]), k


# --- tied embeddings --------------------------------------------------------------------------


def _tied(model) -> bool:
    return model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_tied_embeddings_share_storage(stories, built):
    assert _tied(built) and _tied(stories.model)
    assert built.config.tie_word_embeddings


# --- convert → plain transformers ---------------------------------------------------------------


def test_convert_round_trip_with_plain_transformers(tmp_path, built, sequence):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = llama2c.convert_llama2c(BIN, TOK, tmp_path / "hf")
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert _tied(model)
    assert tok("Zoo")["input_ids"] == GOLDEN_IDS
    assert tok.decode(sequence, skip_special_tokens=True) == GOLDEN_TEXT
    for k, v in built.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    x = torch.tensor([sequence])
    with torch.no_grad():
        assert torch.equal(model(x).logits, built(x).logits)
    # the stop rule travels with the directory: BOS-delimited stories stop at EOS or BOS
    assert set(model.generation_config.eos_token_id) == {1, 2}
    # and a second save → load is bit-exact too
    model.save_pretrained(tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        assert torch.equal(again(x).logits, model(x).logits)


def test_convert_loads_through_unmask(tmp_path):
    out = llama2c.convert_llama2c(BIN, TOK, tmp_path / "hf")
    bundle = unmask.load(str(out))
    assert set(bundle.stop_token_ids) == {1, 2}
    gen = unmask.generate("Zoo", model=bundle, max_new_tokens=56)
    assert "Zoo" + gen.texts[0] == GOLDEN_TEXT


# --- corrupt inputs -----------------------------------------------------------------------------


def _copy(tmp_path: Path, src: Path, name: str | None = None) -> Path:
    dst = tmp_path / (name or src.name)
    dst.write_bytes(src.read_bytes())
    return dst


def test_missing_checkpoint(tmp_path):
    with pytest.raises(UnmaskError, match="not found"):
        llama2c.read_checkpoint(tmp_path / "nope.bin")
    with pytest.raises(UnmaskError, match="not found"):
        llama2c.read_tokenizer(tmp_path / "nope.bin")


def test_wrong_size(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(BIN.read_bytes()[:-4])
    with pytest.raises(UnmaskError, match="bytes"):
        llama2c.read_checkpoint(bad)
    bad.write_bytes(BIN.read_bytes() + b"\0\0\0\0")
    with pytest.raises(UnmaskError, match="bytes"):
        llama2c.read_checkpoint(bad)
    bad.write_bytes(b"\1\2\3")
    with pytest.raises(UnmaskError, match="too small"):
        llama2c.read_checkpoint(bad)


@pytest.mark.parametrize("field,value", [(0, 0), (3, 0), (3, 7), (4, 3), (5, 0), (2, -5)])
def test_bad_header(tmp_path, field, value):
    raw = bytearray(BIN.read_bytes())
    struct.pack_into("<i", raw, 4 * field, value)
    bad = tmp_path / "model.bin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(UnmaskError):
        llama2c.read_checkpoint(bad)


def test_wrong_sha256_of_known_name(tmp_path):
    raw = bytearray(BIN.read_bytes())
    raw[1000] ^= 0x01  # inside the embedding: size and header stay valid
    bad = tmp_path / "stories260K.bin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(UnmaskError, match="sha256"):
        llama2c.read_checkpoint(bad)
    header, _ = llama2c.read_checkpoint(bad, verify=False)  # --no-verify accepts it
    assert header.dim == 64
    with pytest.raises(UnmaskError, match="sha256"):
        llama2c.convert_llama2c(bad, TOK, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wrong_sha256_of_tokenizer(tmp_path):
    raw = bytearray(TOK.read_bytes())
    raw[5] ^= 0x01  # a score byte: still parses
    bad = tmp_path / "tok512.bin"
    bad.write_bytes(bytes(raw))
    with pytest.raises(UnmaskError, match="sha256"):
        llama2c.read_tokenizer(bad, vocab_size=512)


def test_corrupt_tokenizer(tmp_path):
    bad = tmp_path / "tok.bin"
    bad.write_bytes(TOK.read_bytes()[:-3])  # last record cut short
    with pytest.raises(UnmaskError):
        llama2c.read_tokenizer(bad, vocab_size=512)
    bad.write_bytes(TOK.read_bytes()[:100])  # too few pieces for the checkpoint
    with pytest.raises(UnmaskError):
        llama2c.read_tokenizer(bad, vocab_size=512)


def test_existing_out_dir_needs_overwrite(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(UnmaskError, match="exists"):
        llama2c.convert_llama2c(BIN, TOK, out)
    assert (out / "keep.txt").read_text() == "mine"
    with pytest.raises(UnmaskError, match="not a model directory"):  # --overwrite replaces only a model directory
        llama2c.convert_llama2c(BIN, TOK, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "config.json").write_text("{}")  # an earlier conversion's directory
    llama2c.convert_llama2c(BIN, TOK, out, overwrite=True)
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging leftovers


def test_failure_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def broken_save(self, *args, **kwargs):  # the model is already written when this fails
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", broken_save)
    with pytest.raises(UnmaskError, match="disk full"):
        llama2c.convert_llama2c(BIN, TOK, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
