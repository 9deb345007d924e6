"""llama2.c checkpoints and tokenizers, converted to standard Hugging Face objects.

Implements spec/models.md §1: the legacy (version 0) ``.bin`` checkpoint format, the
``tok512.bin``-style tokenizer format, the rotary q/k row permutation that maps llama2.c's
interleaved RoPE onto HF's rotate-half RoPE, and a ``tokenizers`` BPE whose encoding equals
llama2.c's greedy score-merge encoder. ``convert_llama2c`` writes a directory that plain
``AutoModelForCausalLM`` / ``AutoTokenizer`` load with no unmask code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from unmask.errors import UnmaskError
from unmask.fileio import (check_model_out_dir, output_lock, probe_writable, publish_dir, staging_dir, sweep_stale_staging,
                           write_errors)

# sha256 of the genuine files (spec/models.md §1.1); look-alikes with the same header exist.
KNOWN_SHA256 = {
    "stories260K.bin": "b0a507e7ad0f626624f17112325e66691f9076d622e1d3274d103d00299f2696",
    "tok512.bin": "037cb335abb25d1fa9e8ecae30ed2a3a8ace9302862ebcdc05d51a6bbb10c312",
}

_HEADER = struct.Struct("<7i")
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
SPECIAL_NAMES = {UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}


@dataclass(frozen=True)
class Llama2cHeader:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int  # negative in the file means an untied classifier follows
    seq_len: int

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    def n_floats(self) -> int:
        """Number of float32 values the body must hold (spec/models.md §1.2)."""
        d, h, n, v = self.dim, self.hidden_dim, self.n_layers, abs(self.vocab_size)
        kv = self.n_kv_heads * self.head_size
        per_layer = 2 * d + d * d + 2 * kv * d + d * d + 3 * h * d
        total = v * d + n * per_layer + d + self.seq_len * self.head_size  # freq tables: 2 × seq × hs/2
        if self.vocab_size < 0:
            total += v * d
        return total


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _verify_known(path: Path) -> None:
    want = KNOWN_SHA256.get(path.name)
    if want is not None and _sha256(path) != want:
        raise UnmaskError(
            f"{path} is not the genuine {path.name} (sha256 mismatch); use the file from "
            "shared/data/tinyllamas-stories260K or rename it and pass --no-verify"
        )


def read_checkpoint(path: str | os.PathLike, verify: bool = True) -> tuple[Llama2cHeader, dict]:
    """Read a legacy llama2.c checkpoint.

    Returns the header and a dict of float32 tensors in llama2.c layout: ``token_embedding``
    (V, d), ``rms_att`` (n, d), ``wq`` (n, d, d), ``wk``/``wv`` (n, kv, d), ``wo`` (n, d, d),
    ``rms_ffn`` (n, d), ``w1``/``w3`` (n, h, d), ``w2`` (n, d, h), ``rms_final`` (d,) and
    ``wcls`` (V, d) when untied. The RoPE frequency tables are skipped (recomputed by HF).

    Raises UnmaskError when the file is missing, its header is implausible, its size does not
    match the header exactly, or (``verify``) a file named like a known checkpoint has the
    wrong sha256.
    """
    path = Path(path)
    if not path.is_file():
        raise UnmaskError(f"checkpoint file not found: {path}; pass the llama2.c .bin checkpoint (e.g. stories260K.bin)")
    raw = path.read_bytes()
    if len(raw) < _HEADER.size:
        raise UnmaskError(f"{path} is too small to be a llama2.c checkpoint ({len(raw)} bytes); pass the checkpoint "
                          "first and the tokenizer second")
    header = Llama2cHeader(*_HEADER.unpack_from(raw, 0))
    fields = (header.dim, header.hidden_dim, header.n_layers, header.n_heads, header.n_kv_heads, header.seq_len)
    if min(fields) <= 0 or header.vocab_size == 0 or header.dim % header.n_heads or header.n_heads % header.n_kv_heads:
        raise UnmaskError(f"{path} has an invalid llama2.c header {fields}; pass a legacy (v0) llama2.c checkpoint "
                          "first and the tokenizer second")
    if header.head_size % 2:  # rotary embeddings rotate pairs of dimensions
        raise UnmaskError(f"{path} has an odd head size {header.head_size} (dim {header.dim} / {header.n_heads} heads); "
                          "rotary embeddings need an even head size, pass a valid llama2.c checkpoint")
    expected = _HEADER.size + 4 * header.n_floats()
    if len(raw) != expected:
        raise UnmaskError(
            f"{path} is {len(raw)} bytes but its header implies {expected} (truncated or not a v0 export); "
            "download or export the checkpoint again"
        )
    if verify:
        _verify_known(path)
    flat = torch.frombuffer(bytearray(raw[_HEADER.size:]), dtype=torch.float32)
    d, h, n, v = header.dim, header.hidden_dim, header.n_layers, abs(header.vocab_size)
    kv = header.n_kv_heads * header.head_size
    shapes = [
        ("token_embedding", (v, d)), ("rms_att", (n, d)), ("wq", (n, d, d)), ("wk", (n, kv, d)),
        ("wv", (n, kv, d)), ("wo", (n, d, d)), ("rms_ffn", (n, d)), ("w1", (n, h, d)),
        ("w2", (n, d, h)), ("w3", (n, h, d)), ("rms_final", (d,)),
        ("freq_cis", (header.seq_len * header.head_size,)),
    ]
    if header.vocab_size < 0:
        shapes.append(("wcls", (v, d)))
    tensors, offset = {}, 0
    for name, shape in shapes:
        count = 1
        for s in shape:
            count *= s
        tensors[name] = flat[offset : offset + count].view(shape).clone()
        offset += count
    del tensors["freq_cis"]
    return header, tensors


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder q/k rows from interleaved-pair RoPE (llama2.c) to rotate-half RoPE (HF).

    w: (n_heads · hd, d_in) -> same shape, rows within each head reordered as
    [even pair members, odd pair members] (spec/models.md §1.4).
    """
    out_dim, d_in = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, d_in).transpose(1, 2).reshape(out_dim, d_in)  # (n·hd, d_in)


def build_hf_model(header: Llama2cHeader, tensors: dict):
    """Build a ``LlamaForCausalLM`` (float32) holding the llama2.c weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = header.vocab_size > 0
    config = LlamaConfig(
        vocab_size=abs(header.vocab_size),
        hidden_size=header.dim,
        intermediate_size=header.hidden_dim,
        num_hidden_layers=header.n_layers,
        num_attention_heads=header.n_heads,
        num_key_value_heads=header.n_kv_heads,
        head_dim=header.head_size,
        max_position_embeddings=header.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": tensors["token_embedding"], "model.norm.weight": tensors["rms_final"]}
    for i in range(header.n_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = tensors["rms_att"][i]
        state[p + "self_attn.q_proj.weight"] = permute_rotary(tensors["wq"][i], header.n_heads)
        state[p + "self_attn.k_proj.weight"] = permute_rotary(tensors["wk"][i], header.n_kv_heads)
        state[p + "self_attn.v_proj.weight"] = tensors["wv"][i]
        state[p + "self_attn.o_proj.weight"] = tensors["wo"][i]
        state[p + "post_attention_layernorm.weight"] = tensors["rms_ffn"][i]
        state[p + "mlp.gate_proj.weight"] = tensors["w1"][i]
        state[p + "mlp.up_proj.weight"] = tensors["w3"][i]
        state[p + "mlp.down_proj.weight"] = tensors["w2"][i]
    if not tied:
        state["lm_head.weight"] = tensors["wcls"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"llama2.c mapping is incomplete: missing={missing} unexpected={unexpected}")
    if tied:
        model.tie_weights()
    # TinyStories documents are BOS-delimited: llama2.c stops at BOS, unmask at BOS or EOS (§1.5).
    model.generation_config.eos_token_id = [EOS_ID, BOS_ID]
    model.generation_config.pad_token_id = UNK_ID
    return model.eval()


# --- tokenizer ---------------------------------------------------------------------------


def read_tokenizer(path: str | os.PathLike, vocab_size: int | None = None, verify: bool = True) -> tuple[list[bytes], list[float]]:
    """Read a llama2.c ``tokenizer.bin``: int32 max_token_length, then (float32 score, int32 len,
    bytes) records. Returns (pieces, scores). ``vocab_size`` defaults to reading until EOF."""
    path = Path(path)
    if not path.is_file():
        raise UnmaskError(f"tokenizer file not found: {path}; pass the llama2.c tokenizer (e.g. tok512.bin)")
    raw = path.read_bytes()
    pieces, scores, off = [], [], 4
    try:
        (max_len,) = struct.unpack_from("<i", raw, 0)
        while off < len(raw) and (vocab_size is None or len(pieces) < vocab_size):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            if n < 0 or n > max(max_len, 64) or off + n > len(raw):
                raise struct.error("bad record")
            pieces.append(raw[off : off + n])
            scores.append(score)
            off += n
    except struct.error:
        raise UnmaskError(f"{path} is not a valid llama2.c tokenizer file (corrupt record at byte {off}); pass a "
                          "llama2.c tokenizer.bin as the second argument") from None
    if vocab_size is not None and len(pieces) != vocab_size:
        raise UnmaskError(f"{path} holds {len(pieces)} pieces but the checkpoint needs {vocab_size}; pass the tokenizer "
                          "the checkpoint was trained with")
    if verify:
        _verify_known(path)
    return pieces, scores


def _piece_name(i: int, piece: bytes) -> str:
    if i in SPECIAL_NAMES:
        return SPECIAL_NAMES[i]
    return piece.decode("utf-8")


def build_hf_tokenizer(pieces: list[bytes], scores: list[float]):
    """A ``tokenizers`` BPE with byte fallback equal to llama2.c's encoder (spec/models.md §1.5).

    llama2.c repeatedly merges the adjacent pair whose concatenation is the vocabulary piece of
    highest score. A BPE whose merges are ranked by the score of their result performs the same
    merges; a dummy-prefix space is prepended to non-empty text, BOS is added by the post-processor,
    and decoding maps ``<0xHH>`` to raw bytes and drops the leading space after BOS.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from tokenizers import AddedToken

    names = [_piece_name(i, p) for i, p in enumerate(pieces)]
    vocab = {name: i for i, name in enumerate(names)}
    mergeable = {name: i for i, name in enumerate(names) if i not in SPECIAL_NAMES and not (name.startswith("<0x") and len(name) == 6)}
    merges = []
    for name, i in mergeable.items():
        for cut in range(1, len(name)):
            left, right = name[:cut], name[cut:]
            if left in mergeable and right in mergeable:
                merges.append((-scores[i], i, cut, left, right))
    merges.sort()  # highest result score first; stable by id and split point
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token="<unk>", byte_fallback=True, fuse_unk=False)
    )
    tok.normalizer = normalizers.Prepend(" ")
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(SPECIAL_NAMES[i], special=True, normalized=False) for i in sorted(SPECIAL_NAMES)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tok


def wrap_tokenizer(tok):
    """Wrap a ``tokenizers.Tokenizer`` into a transformers fast tokenizer.

    ``split_special_tokens``: llama2.c encodes the text ``"<s>"`` as the characters ``<``, ``s``,
    ``>``; without it a prompt containing that text would turn into a BOS id. The flag is saved in
    tokenizer_config.json, so ``AutoTokenizer`` restores it.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>",
        add_bos_token=True, clean_up_tokenization_spaces=False, model_max_length=10**6,
        split_special_tokens=True,
    )


def convert_llama2c(checkpoint: str | os.PathLike, tokenizer: str | os.PathLike, out_dir: str | os.PathLike,
                    *, overwrite: bool = False, verify: bool = True) -> Path:
    """``unmask convert llama2c``: write a Hugging Face directory (config.json, model.safetensors,
    tokenizer.json, tokenizer_config.json) for a llama2.c checkpoint + tokenizer.

    The directory is assembled in a temporary sibling and renamed into place, so an interrupted
    or failed conversion never leaves a half-written ``out_dir``.

    ``out_dir`` is locked against a second writer for the whole conversion.

    Raises UnmaskError for missing/corrupt inputs, an unnamed ``out_dir``, one holding an input, an
    existing ``out_dir`` without ``overwrite`` (with it, a folder that is not a model directory),
    another process writing ``out_dir``, or a write that fails (full disk, no permission).
    """
    out = check_model_out_dir(out_dir, [checkpoint, tokenizer], overwrite)
    with output_lock(out, "OUT_DIR"):
        return _convert(checkpoint, tokenizer, out, overwrite=overwrite, verify=verify)


def _convert(checkpoint, tokenizer, out: Path, *, overwrite: bool, verify: bool) -> Path:
    
    if out.exists() and not overwrite:
        raise UnmaskError(f"{out} already exists; choose another OUT_DIR or pass --overwrite")
    if out.exists() and not out.is_dir():
        raise UnmaskError(f"{out} is a file, not a model directory; choose another OUT_DIR or remove the file")
    probe_writable(out.parent, f"OUT_DIR {out}")
    sweep_stale_staging(out)  # a killed conversion's half-written copy (the caller holds the lock)
    header, tensors = read_checkpoint(checkpoint, verify=verify)
    pieces, scores = read_tokenizer(tokenizer, vocab_size=abs(header.vocab_size), verify=verify)
    model = build_hf_model(header, tensors)
    hf_tok = wrap_tokenizer(build_hf_tokenizer(pieces, scores))
    hf_tok.model_max_length = header.seq_len
    tmp = None
    try:
        with write_errors(out, "free disk space or choose a writable OUT_DIR"):
            tmp = staging_dir(out)
            model.save_pretrained(tmp)
            hf_tok.save_pretrained(tmp)
            publish_dir(tmp, out)
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
