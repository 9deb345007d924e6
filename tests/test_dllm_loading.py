"""Loading masked-diffusion directories (spec/models.md §2.1, §2.3–2.4): mask id and logit shift from
unmask_config.json, the HF config, the tokenizer or explicit options; LLaDA/Dream-style remote code
through AutoModel with trust_remote_code, offline, using a tiny stand-in model file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import unmask
from unmask.decode import DECODERS
from unmask.errors import UnmaskError
from unmask.models.adapters import family_of, is_remote, loader_name
from unmask.models.mask_token import add_mask_token

STORIES = Path(unmask.__file__).parent / "checkpoints" / "stories260K"


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """stories260K with an added mask token (id 512), saved as a plain HF directory."""
    out = tmp_path_factory.mktemp("dlm") / "base"
    bundle = unmask.load("stories260K")
    add_mask_token(bundle.model)
    bundle.model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    return out


def variant(base: Path, tmp_path: Path, *, unmask_config=None, config=None, tokenizer_config=None) -> Path:
    out = tmp_path / "variant"
    shutil.copytree(base, out)
    if unmask_config is not None:
        (out / "unmask_config.json").write_text(json.dumps(unmask_config))
    for name, extra in (("config.json", config), ("tokenizer_config.json", tokenizer_config)):
        if extra:
            data = json.loads((out / name).read_text())
            data.update(extra)
            (out / name).write_text(json.dumps(data))
    return out


def test_unmask_config_gives_kind_mask_and_shift(base_dir, tmp_path):
    path = variant(base_dir, tmp_path, unmask_config={"kind": "masked-diffusion", "mask_token_id": 512,
                                                      "logit_shift": 1})
    bundle = unmask.load(str(path))
    assert (bundle.kind, bundle.mask_token_id, bundle.logit_shift) == ("masked-diffusion", 512, 1)
    assert 512 in bundle.suppress_ids
    over = unmask.load(str(path), logit_shift=0, mask_token_id=0, force_mask_id=True)
    assert (over.logit_shift, over.mask_token_id) == (0, 0)
    out = unmask.generate(["Once upon a time"], bundle, max_new_tokens=8, block_size=8, cache="prefix")
    assert out.decoder == "diffusion" and len(out.tokens[0]) <= 8


def test_mask_id_from_hf_config_and_tokenizer(base_dir, tmp_path):
    path = variant(base_dir, tmp_path, config={"mask_token_id": 512})
    bundle = unmask.load(str(path), kind="masked-diffusion")
    assert (bundle.mask_token_id, bundle.logit_shift) == (512, 0)
    causal = unmask.load(str(path))
    assert causal.kind == "causal"


def test_missing_or_conflicting_mask_ids_are_errors(base_dir, tmp_path):
    with pytest.raises(UnmaskError, match="names no mask token; pass mask_token_id"):
        unmask.load(str(base_dir), kind="masked-diffusion")
    clash = variant(base_dir, tmp_path, config={"mask_token_id": 512}, tokenizer_config={"mask_token": "<unk>"})
    with pytest.raises(UnmaskError, match="names mask token 512 but the tokenizer's is 0"):
        unmask.load(str(clash), kind="masked-diffusion")
    assert unmask.load(str(clash), kind="masked-diffusion", mask_token_id=512).mask_token_id == 512
    with pytest.raises(UnmaskError, match="outside the model's vocabulary of 513"):
        unmask.load(str(base_dir), kind="masked-diffusion", mask_token_id=600)
    with pytest.raises(UnmaskError, match="logit_shift must be 0 or 1"):
        unmask.load(str(base_dir), kind="masked-diffusion", mask_token_id=512, logit_shift=2)


@pytest.mark.parametrize("mask_id, what", [(0, "special token '<unk>'"), (2, "special token '</s>'"),
                                            (100, "ordinary vocabulary token")])
def test_a_vocabulary_token_is_refused_as_mask_id_unless_forced(mask_id, what):
    with pytest.raises(UnmaskError, match=f"mask_token_id {mask_id} is the {what}.*force_mask_id=True"):
        unmask.load("stories260K-dlm", mask_token_id=mask_id)
    assert unmask.load("stories260K-dlm", mask_token_id=mask_id, force_mask_id=True).mask_token_id == mask_id
    assert unmask.load("stories260K-dlm", mask_token_id=512).mask_token_id == 512  # the checkpoint's own


def test_an_added_row_without_a_token_is_a_valid_explicit_mask_id(base_dir):
    assert unmask.load(str(base_dir), kind="masked-diffusion", mask_token_id=512).mask_token_id == 512


# -- remote-code families ------------------------------------------------------------------------

CONFIG_PY = '''
from transformers import PretrainedConfig


class FakeDLLMConfig(PretrainedConfig):
    model_type = "{model_type}"

    def __init__(self, vocab_size=513, hidden_size=16, mask_token_id=None, **kwargs):
        self.vocab_size, self.hidden_size, self.mask_token_id = vocab_size, hidden_size, mask_token_id
        super().__init__(**kwargs)
'''

MODELING_PY = '''
import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_fake import FakeDLLMConfig

CALLS = []


class FakeDLLM(PreTrainedModel):
    """Bidirectional toy: every position adds the mean embedding of the valid tokens."""

    config_class = FakeDLLMConfig

    def __init__(self, config):
        super().__init__(config)
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        CALLS.append({"mask": attention_mask if isinstance(attention_mask, str) or attention_mask is None
                      else tuple(attention_mask.shape), "positions": position_ids is not None, "extra": sorted(kwargs)})
        h = self.embed(input_ids)
        if attention_mask is None or isinstance(attention_mask, str):
            w = torch.ones(input_ids.shape, dtype=h.dtype)
        elif attention_mask.dim() == 2:
            w = attention_mask.to(h.dtype)
        else:
            w = attention_mask[:, 0, -1].to(h.dtype)
        ctx = (h * w[..., None]).sum(1, keepdim=True) / w.sum(1)[:, None, None]
        return CausalLMOutput(logits=self.head(h + ctx))
'''


def remote_dir(tmp_path: Path, model_type: str, mask_token_id: int | None = 512) -> Path:
    from safetensors.torch import save_file

    out = tmp_path / f"remote-{model_type}"
    out.mkdir()
    (out / "configuration_fake.py").write_text(CONFIG_PY.format(model_type=model_type))
    (out / "modeling_fake.py").write_text(MODELING_PY)
    config = {"model_type": model_type, "architectures": ["FakeDLLM"], "vocab_size": 513, "hidden_size": 16,
              "auto_map": {"AutoConfig": "configuration_fake.FakeDLLMConfig", "AutoModel": "modeling_fake.FakeDLLM"}}
    if mask_token_id is not None:
        config["mask_token_id"] = mask_token_id
    (out / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    save_file({"embed.weight": torch.randn(513, 16), "head.weight": torch.randn(513, 16)}, out / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / name, out / name)
    return out


def test_family_detection_and_loader():
    assert family_of({"model_type": "llada"}).logit_shift == 0
    assert family_of({"model_type": "Dream"}).logit_shift == 1
    assert family_of({"architectures": ["LLaDAModelLM"]}).name == "llada"
    assert family_of({"model_type": "llama"}) is None
    assert loader_name({"auto_map": {"AutoModel": "m.X"}}, None) == "AutoModel"
    assert loader_name({"auto_map": {"AutoModel": "m.X", "AutoModelForCausalLM": "m.X"}}, None) == "AutoModelForCausalLM"
    assert loader_name({"auto_map": {"AutoModel": "m.X", "AutoModelForCausalLM": "m.X"}},
                       family_of({"model_type": "llada"})) == "AutoModel"
    assert loader_name({}, None) == "AutoModelForCausalLM"


@pytest.mark.parametrize("model_type, shift, sampler", [("llada", 0, "llada"), ("Dream", 1, "dream")])
def test_remote_code_dllm_loads_through_automodel(tmp_path, model_type, shift, sampler):
    path = remote_dir(tmp_path, model_type)
    with pytest.raises(UnmaskError, match="ships its own model code"):
        unmask.load(str(path))
    bundle = unmask.load(str(path), trust_remote_code=True)
    assert is_remote(bundle.model) and type(bundle.model).__name__ == "FakeDLLM"
    assert (bundle.kind, bundle.mask_token_id, bundle.logit_shift) == ("masked-diffusion", 512, shift)
    calls = __import__(type(bundle.model).__module__, fromlist=["CALLS"]).CALLS
    calls.clear()
    prompts = [bundle.encode("Once upon a time"), bundle.encode("Lily")]
    out = DECODERS["diffusion"].decode(bundle, prompts, max_new_tokens=8, block_size=4, steps=4)
    assert out.stats.nfe == 4 and out.stats.extra["sampler"] == sampler
    single = DECODERS["diffusion"].decode(bundle, prompts[:1], max_new_tokens=8, block_size=4, steps=4)
    if model_type == "llada":  # 2D padding mask when padded, nothing otherwise; positions are internal
        assert calls[0]["mask"] == (2, len(prompts[0]) + 8) and not calls[0]["positions"]
        assert calls[-1]["mask"] is None
    else:  # Dream: 4D bool mask with positions when padded, "full" otherwise
        assert calls[0]["mask"] == (2, 1, len(prompts[0]) + 8, len(prompts[0]) + 8) and calls[0]["positions"]
        assert calls[-1]["mask"] == "full"
    assert single.tokens[0] == out.tokens[0]
    with pytest.raises(UnmaskError, match="use --cache none"):
        DECODERS["diffusion"].decode(bundle, prompts, max_new_tokens=8, block_size=4, cache="dual")


def test_llada_family_mask_id_default_and_dream_without_one(tmp_path):
    with pytest.raises(UnmaskError, match="mask token id 126336 is outside"):  # LLaDA's documented id
        unmask.load(str(remote_dir(tmp_path, "llada", mask_token_id=None)), trust_remote_code=True)
    with pytest.raises(UnmaskError, match="names no mask token"):  # Dream's id must come from its config
        unmask.load(str(remote_dir(tmp_path, "Dream", mask_token_id=None)), trust_remote_code=True)
