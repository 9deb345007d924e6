"""Issue 28, models and training surfaces: the lossless guarantee of adapters (item 17), adapter
files that are malformed (18), absurd training options, exploded runs, ``--targets`` and duplicated
distillation rows (19), ``convert gguf`` of other architectures, incomplete files and stale
staging folders (23), and publishing onto a full disk (24)."""

from __future__ import annotations

import errno
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import STORIES_DIR, ids_file, one_line_error, run_cli, tiny_llama

import unmask
from unmask.errors import UnmaskError
from unmask.models.adapter_io import ADAPTER_JSON, ADAPTER_WEIGHTS, adapter_config, save_adapter, weights_hash
from unmask.models.sbd_adapter import AdapterSpec, attach

ENOSPC = OSError(errno.ENOSPC, "No space left on device")


def _siblings(path: Path) -> list[str]:
    """Hidden entries next to ``path`` that belong to it (staging folders, temporary files)."""
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(f".{path.name}."))


# ---------------------------------------------------------------------------------------------
# Adapters: the mask id (item 17) and malformed adapter files (item 18)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A random rank-4 adapter for stories260K with the new mask id 512, saved once."""
    where = tmp_path_factory.mktemp("adapter") / "good"
    bundle = unmask.load("stories260K")
    ad = attach(bundle.model, AdapterSpec(rank=4, mask_token_id=512, base_vocab=512))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ad.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    save_adapter(ad, where, adapter_config(ad, base_name="stories260K", base_sha256=weights_hash(bundle.path),
                                           decode_defaults={"verify": True, "verify_block_size": 4}))
    return where


def _variant(adapter_dir: Path, tmp_path: Path, edit=None, tensors=None) -> Path:
    """A copy of the fixture adapter with ``edit(config)`` applied to adapter.json and
    ``tensors(state) -> state`` to adapter.safetensors."""
    from safetensors.torch import load_file, save_file

    where = tmp_path / "variant"
    shutil.copytree(adapter_dir, where)
    if edit is not None:
        cfg = json.loads((where / ADAPTER_JSON).read_text())
        edit(cfg)
        (where / ADAPTER_JSON).write_text(json.dumps(cfg))
    if tensors is not None:
        save_file(tensors(load_file(str(where / ADAPTER_WEIGHTS))), str(where / ADAPTER_WEIGHTS))
    return where


@pytest.mark.parametrize("text", [",", " was"])
def test_adapter_mask_id_of_an_ordinary_token_is_refused(adapter_dir, tmp_path, capsys, stories, text):
    token = stories.tokenizer(text)["input_ids"][-1]
    where = _variant(adapter_dir, tmp_path, lambda c: c.update(mask_token_id=token))
    with pytest.raises(UnmaskError, match=rf"mask token id {token}, which is the ordinary vocabulary token"):
        unmask.load("stories260K", adapter=where)
    line = one_line_error(capsys, "generate", "--model", "stories260K", "--adapter", where, "--decoder", "sbd",
                          "-n", "4", "Once upon a time", match="lossless SBD would not match AR")
    assert str(where / ADAPTER_JSON) in line


def test_adapter_mask_id_must_be_the_base_s_own_mask_token(adapter_dir, tmp_path, stories):
    """The new id (512) loads; on a base that names a mask token (an sbd model) only that id does."""
    assert unmask.load("stories260K", adapter=adapter_dir).mask_token_id == 512
    from unmask.models.adapter_io import check_adapter_mask_id

    bundle = unmask.load("stories260K")
    bundle.mask_token_id = 300  # as a base that names its own mask token
    check_adapter_mask_id(bundle, 300, "adapter x")
    with pytest.raises(UnmaskError, match="names 300 as its mask token"):
        check_adapter_mask_id(bundle, 301, "adapter x")


BAD_CONFIGS = [
    ("decode_defaults", lambda c: c.update(decode_defaults={"bogus": 1}), "unknown decode_defaults key 'bogus'"),
    ("decode_defaults", lambda c: c.update(decode_defaults=[1, 2]), "'decode_defaults' must be a JSON object"),
    ("decode_defaults", lambda c: c.update(decode_defaults={"draft": "zigzag"}), "unknown draft layout"),
    ("decode_defaults", lambda c: c.update(decode_defaults={"verify": "yes"}), "verify must be true or false"),
    ("target_modules", lambda c: c.update(target_modules="q_proj"), "'target_modules' must be a non-empty list"),
    ("target_modules", lambda c: c.update(target_modules=[1, 2]), "'target_modules' must be a non-empty list"),
    ("target_modules", lambda c: c.update(target_modules=[["q_proj"]]), "'target_modules' must be a non-empty"),
    ("target_modules", lambda c: c.update(target_modules=["q_proj", "zz"]), "no linear layer named 'zz'"),
    ("rank", lambda c: c.update(rank="4"), "'rank' must be null (full rank) or an integer"),
    ("rank", lambda c: c.update(rank=4.0), "'rank' must be null (full rank) or an integer"),
    ("rank", lambda c: c.update(rank=65), "'rank' 65 exceeds the hidden size 64"),
    ("mask_token_id", lambda c: c.update(mask_token_id="512"), "'mask_token_id' must be an integer"),
    ("mask_token_id", lambda c: c.update(mask_token_id=512.5), "'mask_token_id' must be an integer"),
    ("base_vocab_size", lambda c: c.update(base_vocab_size="x"), "'base_vocab_size' must be an integer"),
    ("base", lambda c: c.update(base="stories260K"), "'base' must be an object"),
    ("full_rank", lambda c: c.update(full_rank=True), "'full_rank' must be False"),
]


@pytest.mark.parametrize("key,edit,match", BAD_CONFIGS, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(BAD_CONFIGS)])
def test_malformed_adapter_json_is_one_error_naming_file_and_key(adapter_dir, tmp_path, capsys, key, edit, match):
    where = _variant(adapter_dir, tmp_path, edit)
    with pytest.raises(UnmaskError, match=match.replace("(", r"\(").replace(")", r"\)")):
        unmask.load("stories260K", adapter=where)
    line = one_line_error(capsys, "generate", "--model", "stories260K", "--adapter", where, "--decoder", "sbd",
                          "-n", "4", "Once upon a time", match=key)
    assert str(where / ADAPTER_JSON) in line


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_non_float_adapter_tensors_are_refused(adapter_dir, tmp_path, dtype):
    where = _variant(adapter_dir, tmp_path, tensors=lambda s: {k: (v * 1000).to(dtype) for k, v in s.items()})
    with pytest.raises(UnmaskError, match=rf"{ADAPTER_WEIGHTS}: tensor \S+ is {str(dtype)[6:]}, not a floating"):
        unmask.load("stories260K", adapter=where)


def test_half_precision_adapter_tensors_still_load(adapter_dir, tmp_path):
    where = _variant(adapter_dir, tmp_path, tensors=lambda s: {k: v.half() for k, v in s.items()})
    assert unmask.load("stories260K", adapter=where).kind == "sbd"


def test_set_adapter_decode_defaults_refuses_unknown_keys(adapter_dir, tmp_path):
    from unmask.models.adapter_io import set_adapter_decode_defaults

    where = _variant(adapter_dir, tmp_path)
    before = (where / ADAPTER_JSON).read_bytes()
    with pytest.raises(UnmaskError, match="unknown decode_defaults key 'blocksize'"):
        set_adapter_decode_defaults(where, blocksize=4)
    assert (where / ADAPTER_JSON).read_bytes() == before
    assert set_adapter_decode_defaults(where, block_size=4, gamma=0.5)["decode_defaults"] == {"block_size": 4,
                                                                                              "gamma": 0.5}


def test_attach_refuses_a_rank_above_the_hidden_size_and_unknown_targets():
    with pytest.raises(UnmaskError, match="rank 33 exceeds the hidden size 32"):
        attach(tiny_llama(), AdapterSpec(rank=33, mask_token_id=64, base_vocab=64))
    attach(tiny_llama(), AdapterSpec(rank=32, mask_token_id=64, base_vocab=64))  # the hidden size itself is fine
    with pytest.raises(UnmaskError, match="no linear layer named 'qproj'; its layers are: down_proj, gate_proj"):
        attach(tiny_llama(), AdapterSpec(rank=2, mask_token_id=64, base_vocab=64, targets=("q_proj", "qproj")))


# ---------------------------------------------------------------------------------------------
# Training: absurd options, --targets, exploded runs (item 19)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return ids_file(tmp_path_factory.mktemp("corpus") / "c.jsonl", n_docs=16)


FAST = ("--seq-len", 32, "--batch-size", 2, "--warmup", 1, "--eval-every", 0, "--no-progress")


@pytest.mark.parametrize("args,match", [
    (("--lr", "1e30"), "--lr 1e+30 is above 1"),
    (("--lr", "2"), "--lr 2 is above 1"),
    (("--lr", "0.5", "--weight-decay", "2"), "--lr 0.5 x --weight-decay 2 is >= 1"),
    (("--steps", "1000000000"), "--steps 1000000000 is above 100,000,000"),
    (("--warmup", "1000000000"), "--warmup 1000000000 is above"),
    (("--batch-size", "100000000"), "--batch-size 100000000 is above 65,536"),
    (("--grad-accum", "100000000"), "--grad-accum 100000000 is above 65,536"),
    (("--seed", "-1"), "--seed must be in [0, 2**63)"),
    (("--seed", str(2**64)), "--seed must be in [0, 2**63)"),
    (("--rank", "65"), "rank 65 exceeds the hidden size 64"),
    (("--targets", ","), "--targets must be layer names"),
    (("--targets", "q_proj,,v_proj"), "--targets must be layer names"),
    (("--targets", "q_proj,attn"), "no linear layer named 'attn'; its layers are: down_proj"),
])
def test_absurd_adapter_training_options_are_one_line(capsys, tmp_path, corpus, args, match):
    out = tmp_path / "ad"
    line = one_line_error(capsys, "train", "sbd-adapter", "--data", corpus, "--out", out, "--steps", 1, *FAST, *args,
                          match=match)
    assert "Traceback" not in line
    assert not out.exists() and not out.with_name("ad.run").exists()


@pytest.mark.parametrize("command", ["sbd", "diffusion"])
def test_absurd_lr_is_refused_by_every_trainer(capsys, tmp_path, corpus, command):
    one_line_error(capsys, "train", command, "--data", corpus, "--out", tmp_path / "m", "--steps", 1, *FAST,
                   "--lr", "1e30", match="--lr 1e+30 is above 1")
    assert not (tmp_path / "m").exists()


def test_train_config_refuses_wrong_types():
    from unmask.train.loop import TrainConfig

    for field, value in (("steps", 2.5), ("batch_size", True), ("seed", "0"), ("lr", "3e-4")):
        with pytest.raises(UnmaskError, match=f"--{field.replace('_', '-')} must be"):
            TrainConfig(**{field: value})


def test_explicit_targets_train_only_those_layers(tmp_path, corpus):
    from unmask.train.sbd_adapter import train_sbd_adapter

    train_sbd_adapter(base="stories260K", data=corpus, out=tmp_path / "ad", targets=["q_proj", "v_proj"], rank=2,
                      steps=1, seq_len=32, batch_size=2, warmup=1, eval_every=0, progress=False)
    cfg = json.loads((tmp_path / "ad" / ADAPTER_JSON).read_text())
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    from safetensors.torch import load_file

    names = load_file(str(tmp_path / "ad" / ADAPTER_WEIGHTS)).keys()
    assert {n.split(".")[-2] for n in names if "lora" in n} == {"q_proj", "v_proj"}


@pytest.mark.parametrize("initial,final,vocab,want", [
    (2.0, 2.5, 512, False),                      # a little worse: noise, not an explosion
    (2.0, 2.0 + math.log(512) - 1e-3, 512, False),
    (2.0, 2.0 + math.log(512) + 1e-3, 512, True),  # more than a uniform guess's loss above the start
    (16.0, math.log(512), 512, False),           # far below the start
    (2.0, float("nan"), 512, True),
    (2.0, float("inf"), 512, True),
    (None, float("nan"), None, True),            # without a reference only finiteness is checked
    (None, 1e9, 512, False),
    (2.0, 1e9, None, False),
    (2.0, None, 512, False),                     # nothing to judge
])
def test_exploded_rule(initial, final, vocab, want):
    from unmask.train.checkpoint import exploded

    assert exploded(initial, final, vocab) is want


def test_an_exploded_held_out_loss_publishes_nothing(tmp_path, corpus, monkeypatch, capsys):
    """The last held-out loss far above the untrained model's: diverged, nothing published, and
    the final (exploded) weights not checkpointed."""
    import unmask.train.loop as loop

    real = loop.evaluate

    def exploding(*args, **kwargs):
        return {**real(*args, **kwargs), "loss": 1e6}

    monkeypatch.setattr(loop, "evaluate", exploding)
    out = tmp_path / "ad"
    line = one_line_error(capsys, "train", "sbd-adapter", "--data", corpus, "--out", out, "--rank", 2, "--steps", 2,
                          "--ckpt-every", 0, *FAST, match="training diverged: the held-out loss ended at 1e+06")
    assert "more than ln V = 6.24 (a uniform guess over the vocabulary) above the untrained model's" in line
    assert "nothing was published" in line
    assert not out.exists() and _siblings(out) == []
    assert not list((tmp_path / "ad.run" / "checkpoints").glob("step-*"))


def test_weights_beyond_float16_range_are_never_checkpointed(tmp_path):
    from unmask.train import checkpoint

    model = tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = 2.7e30
    with pytest.raises(UnmaskError, match=r"q_proj.weight reaches \|w\| = 2.7e\+30, beyond float16's range"):
        checkpoint.save_checkpoint(tmp_path, 1, model, {"step": 1})
    assert checkpoint.checkpoints(tmp_path) == []
    model.requires_grad_(False)  # a frozen base is not ours to judge (only finiteness)
    checkpoint.save_checkpoint(tmp_path, 1, model, {"step": 1})


def test_huge_trained_weights_stop_the_run_before_publishing(tmp_path, corpus, monkeypatch):
    """lr 1e30 used to publish |w| = 2.7e30 with a finite loss: such weights now stop the run."""
    from unmask.train.sbd_adapter import train_sbd_adapter

    real = torch.optim.AdamW.step

    def blow_up(self, *args, **kwargs):
        result = real(self, *args, **kwargs)
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.mul_(0).add_(2.7e30)
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", blow_up)
    with pytest.raises(UnmaskError, match=r"training diverged: parameter .* reaches \|w\| = 2.7e\+30"):
        # no held-out rows: the loss of step 1 (before the update) is finite, the weights are checked
        train_sbd_adapter(base="stories260K", data=corpus, out=tmp_path / "ad", rank=2, steps=1, seq_len=32,
                          batch_size=2, warmup=1, eval_every=0, val_fraction=0.0, progress=False)
    assert not (tmp_path / "ad").exists()


# ---------------------------------------------------------------------------------------------
# data distill: a duplicated row on resume (item 19)
# ---------------------------------------------------------------------------------------------


def test_distill_resume_refuses_a_duplicated_row(tmp_path, stories):
    from unmask.train.distill import distill

    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe cat sat\nLily went\n")
    out = tmp_path / "c.jsonl"
    distill(out, model=stories, prompts=[prompts], max_new_tokens=4, limit=2)
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0] + lines[1] + lines[0])
    before = out.read_bytes()
    with pytest.raises(UnmaskError, match=r"line 3 repeats prompt 0 of line 1 \(p.txt\).*--overwrite"):
        distill(out, model=stories, prompts=[prompts], max_new_tokens=4, limit=2, resume=True)
    assert out.read_bytes() == before


def test_distill_full_disk_leaves_no_partial_corpus(tmp_path, stories, monkeypatch, capsys):
    import unmask.train.distill as distill_mod

    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\nThe cat sat\n")
    out = tmp_path / "c.jsonl"
    real = os.fsync

    def full(fd):
        raise ENOSPC

    monkeypatch.setattr(distill_mod.os, "fsync", full)
    line = one_line_error(capsys, "data", "distill", "--model", "stories260K", "--prompts", prompts, "--out", out,
                          "-n", 4, "--no-progress", match="No space left on device")
    assert "cannot write --out" in line and not out.exists() and _siblings(out) == []
    # a resumed corpus keeps its whole rows: the failed batch is cut off again
    monkeypatch.setattr(distill_mod.os, "fsync", real)
    code, _, err = run_cli(capsys, "data", "distill", "--model", "stories260K", "--prompts", prompts, "--out", out,
                           "-n", 4, "--no-progress")
    assert code == 0, err
    first = out.read_bytes()[: out.read_bytes().index(b"\n") + 1]
    out.write_bytes(first)
    monkeypatch.setattr(distill_mod.os, "fsync", full)
    code, _, err = run_cli(capsys, "data", "distill", "--model", "stories260K", "--prompts", prompts, "--out", out,
                           "-n", 4, "--no-progress", "--resume")
    assert code == 2 and "No space left" in err and "Traceback" not in err, err
    assert out.read_bytes() == first and _siblings(out) == []


# ---------------------------------------------------------------------------------------------
# convert gguf: architecture, missing tensors, stale staging (item 23)
# ---------------------------------------------------------------------------------------------


def write_gguf(path: Path, arch: str = "llama", drop: tuple[str, ...] = (), vocab: int = 32, d: int = 16,
               layers: int = 2, heads: int = 2, kv_heads: int = 1, ff: int = 32, context: int = 64) -> Path:
    """A tiny random float32 GGUF of ``arch`` with Llama tensor names (minus the tensors in
    ``drop``) and a byte-level llama tokenizer, written with the gguf package's writer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(context)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(vocab - 3)])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([2, 3, 3] + [6] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    hd = d // heads
    shapes = {"token_embd.weight": (vocab, d), "output_norm.weight": (d,), "output.weight": (vocab, d)}
    for i in range(layers):
        shapes.update({f"blk.{i}.attn_norm.weight": (d,), f"blk.{i}.attn_q.weight": (d, d),
                       f"blk.{i}.attn_k.weight": (kv_heads * hd, d), f"blk.{i}.attn_v.weight": (kv_heads * hd, d),
                       f"blk.{i}.attn_output.weight": (d, d), f"blk.{i}.ffn_norm.weight": (d,),
                       f"blk.{i}.ffn_gate.weight": (ff, d), f"blk.{i}.ffn_up.weight": (ff, d),
                       f"blk.{i}.ffn_down.weight": (d, ff)})
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name not in drop:
            w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_of_another_architecture_is_refused(tmp_path, capsys):
    src = write_gguf(tmp_path / "m.gguf", arch="mamba")
    out = tmp_path / "out"
    one_line_error(capsys, "convert", "gguf", src, out, match="holds a mamba model (general.architecture); unmask "
                   "converts the decoder-only transformer architectures llama, mistral, qwen2, qwen3")
    assert not out.exists() and _siblings(out) == []


@pytest.mark.parametrize("missing", ["blk.0.attn_v.weight", "blk.1.ffn_down.weight", "token_embd.weight"])
def test_gguf_missing_a_tensor_is_refused_naming_it(tmp_path, capsys, missing):
    src = write_gguf(tmp_path / "m.gguf", drop=(missing,))
    out = tmp_path / "out"
    one_line_error(capsys, "convert", "gguf", src, out, match=f"lacks the tensor {missing}")
    assert not out.exists() and _siblings(out) == []


def test_complete_gguf_converts_tied_or_not(tmp_path, capsys):
    for name, drop in (("untied", ()), ("tied", ("output.weight",))):
        out = tmp_path / f"out-{name}"
        code, _, err = run_cli(capsys, "convert", "gguf", write_gguf(tmp_path / f"{name}.gguf", drop=drop), out)
        assert code == 0, err
        bundle = unmask.load(out)
        assert bundle.model.config.tie_word_embeddings == (name == "tied")
        assert bundle.model.config.num_hidden_layers == 2


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_staging_of_the_same_out_is_swept(tmp_path, capsys):
    from unmask.fileio import staging_dir

    out = tmp_path / "out"
    dead = tmp_path / f".out.staging-{_dead_pid()}-abcd1234"
    (dead / "sub").mkdir(parents=True)
    (dead / "sub" / "model.safetensors").write_bytes(b"x" * 1000)
    live = tmp_path / f".out.staging-{os.getppid()}-live0000"  # the test runner's parent: alive
    live.mkdir()
    mine = staging_dir(out)  # this process's own
    other = tmp_path / f".other.staging-{_dead_pid()}-zzzz0000"  # another output's
    other.mkdir()
    legacy = tmp_path / ".out.k3j4h5g6"  # not a staging name of ours: never guessed at
    legacy.mkdir()
    link = tmp_path / f".out.staging-{_dead_pid()}-link0000"
    link.symlink_to(legacy)
    code, _, err = run_cli(capsys, "convert", "gguf", write_gguf(tmp_path / "m.gguf"), out)
    assert code == 0, err
    assert not dead.exists()
    assert live.is_dir() and mine.is_dir() and other.is_dir() and legacy.is_dir() and link.is_symlink()


def test_staging_dir_names_its_owner():
    from unmask.fileio import staging_dir

    tmp = staging_dir(Path(os.environ.get("TMPDIR", "/tmp")) / f"unmask-owner-{os.getpid()}")
    try:
        assert tmp.name.startswith(f".unmask-owner-{os.getpid()}.staging-{os.getpid()}-")
    finally:
        tmp.rmdir()


# ---------------------------------------------------------------------------------------------
# Publishing onto a full disk (item 24): one line, nothing half-published
# ---------------------------------------------------------------------------------------------


def _full_disk_for(monkeypatch, out: Path) -> None:
    """Make every safetensors write into ``out``'s staging folder fail with ENOSPC, through both
    entry points that write them (``safetensors.torch.save_file`` and transformers' import of it);
    checkpoints in the run directory still write."""
    import safetensors.torch
    import transformers.modeling_utils

    def wrap(real):
        def save(tensors, filename, *args, **kwargs):
            if f".{out.name}.staging-" in str(filename):
                Path(filename).write_bytes(b"partial")  # the disk filled up half-way
                raise ENOSPC
            return real(tensors, filename, *args, **kwargs)
        return save

    monkeypatch.setattr(safetensors.torch, "save_file", wrap(safetensors.torch.save_file))
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", wrap(transformers.modeling_utils.safe_save_file))


@pytest.mark.parametrize("command", [
    ("train", "sbd-adapter", "--rank", "2"),
    ("train", "sbd"),
    ("train", "diffusion"),
])
def test_full_disk_while_publishing_a_trained_model(monkeypatch, capsys, tmp_path, corpus, command):
    out = tmp_path / "m"
    _full_disk_for(monkeypatch, out)
    line = one_line_error(capsys, *command, "--data", corpus, "--out", out, "--steps", 1, *FAST,
                          match="No space left on device")
    assert f"cannot write the {'adapter' if 'sbd-adapter' in command else 'model'} to {out}" in line
    assert "--resume" in line  # the run is kept: publishing can be retried
    assert not out.exists() and _siblings(out) == []
    assert list((tmp_path / "m.run" / "checkpoints").glob("step-*"))


def test_full_disk_then_resume_publishes(monkeypatch, capsys, tmp_path, corpus):
    out = tmp_path / "m"
    _full_disk_for(monkeypatch, out)
    args = ("train", "sbd-adapter", "--rank", "2", "--data", corpus, "--out", out, "--steps", 1, *FAST)
    one_line_error(capsys, *args, match="No space left on device")
    monkeypatch.undo()
    code, _, err = run_cli(capsys, *args, "--resume")
    assert code == 0, err
    assert unmask.load("stories260K", adapter=out).kind == "sbd"


def test_full_disk_while_converting(monkeypatch, capsys, tmp_path):
    out = tmp_path / "gg"
    _full_disk_for(monkeypatch, out)
    one_line_error(capsys, "convert", "gguf", write_gguf(tmp_path / "m.gguf"), out, match="No space left on device")
    assert not out.exists() and _siblings(out) == []
    out = tmp_path / "l2c"
    _full_disk_for(monkeypatch, out)
    one_line_error(capsys, "convert", "llama2c", STORIES_DIR / "stories260K.bin", STORIES_DIR / "tok512.bin", out,
                   match="No space left on device")
    assert not out.exists() and _siblings(out) == []


def test_full_disk_while_saving_an_adapter(monkeypatch, tmp_path):
    bundle = unmask.load("stories260K")
    ad = attach(bundle.model, AdapterSpec(rank=2, mask_token_id=512, base_vocab=512))
    where = tmp_path / "ad"

    import safetensors.torch

    def full(*args, **kwargs):
        raise ENOSPC

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(UnmaskError, match=f"cannot write the adapter {where}: No space left on device; free"):
        save_adapter(ad, where, adapter_config(ad, base_name="stories260K", base_sha256="sha256:0"))
    assert not (where / ADAPTER_WEIGHTS).exists() and not list(where.glob(".*"))


def test_full_disk_while_writing_a_story_corpus(monkeypatch, capsys, tmp_path):
    import builtins

    import unmask.fileio

    out = tmp_path / "stories.jsonl"
    real = builtins.open

    class Full:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            raise ENOSPC

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fake_open(file, mode="r", *args, **kwargs):
        f = real(file, mode, *args, **kwargs)
        return Full(f) if "w" in mode and f".{out.name}." in str(file) else f

    monkeypatch.setattr(unmask.fileio, "open", fake_open, raising=False)
    one_line_error(capsys, "data", "stories", "--out", out, "--sampled", 2, "--greedy", 0, "--max-new-tokens", 8,
                   "--no-progress", match="No space left on device")
    assert not out.exists() and _siblings(out) == []


def test_set_decode_defaults_of_a_trained_model_refuses_unknown_keys(tmp_path):
    from unmask.train.wiring import set_decode_defaults

    (tmp_path / "unmask_config.json").write_text('{"kind": "sbd"}')
    with pytest.raises(UnmaskError, match="unknown decode_defaults key 'gama'; the sbd decoder's options are"):
        set_decode_defaults(tmp_path, block_size=4, gama=0.3)
    assert json.loads((tmp_path / "unmask_config.json").read_text()) == {"kind": "sbd"}


@pytest.mark.parametrize("seed", [2**70, -(2**62)])
def test_data_stories_names_the_seed_it_was_given(capsys, tmp_path, seed):
    """The corpus samples batch b with seed * 100_003 + b: an out-of-range --seed was reported as
    that derived number, which the user never typed."""
    out = tmp_path / "s.jsonl"
    one_line_error(capsys, "data", "stories", "--out", out, "--sampled", 1, "--greedy", 0, "--no-progress",
                   "--seed", seed, match=f"(got {seed})")
    assert not out.exists()


def test_publishing_a_trained_adapter_sweeps_its_stale_staging(tmp_path, corpus):
    """A run killed while publishing leaves .OUT.staging-PID-*; the next run of the same OUT
    removes it (its owner is gone), and leaves another live process's alone."""
    from unmask.train.sbd_adapter import train_sbd_adapter

    out = tmp_path / "ad"
    dead = tmp_path / f".ad.staging-{_dead_pid()}-k1ll3d00"
    dead.mkdir()
    (dead / ADAPTER_WEIGHTS).write_bytes(b"half")
    live = tmp_path / f".ad.staging-{os.getppid()}-l1ve0000"
    live.mkdir()
    train_sbd_adapter(base="stories260K", data=corpus, out=out, rank=2, steps=1, seq_len=32, batch_size=2, warmup=1,
                      eval_every=0, progress=False)
    assert (out / ADAPTER_WEIGHTS).is_file() and not dead.exists() and live.is_dir()
