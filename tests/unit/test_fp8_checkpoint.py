"""Checkpoints already in block-scaled FP8 (libs/model/fp8_checkpoint.py).

The tests write them themselves: a tiny random Llama saved by transformers, whose
projections are then quantized block by block by ``block_quantize`` below (an independent
writer: plain loops over the 128 x 128 blocks, no code shared with the loader) and stored
as DeepSeek-V3 / vLLM store them (``weight`` e4m3 + ``weight_scale_inv``, config.json's
``quantization_config``). Two shapes:

- unaligned (hidden 192 = 1.5 blocks, intermediate 320, k/v 96 rows): partial blocks on
  both axes, q/k/v parts that do not fill their blocks, and one layer left dense (an
  ``ignored_layers`` entry);
- aligned (every dimension a multiple of 128): what transformers' own FineGrainedFP8
  reader handles, so it serves as an independent reader of the same files.

And MoE checkpoints (Qwen2-MoE with a shared expert, Mixtral's w1/w2/w3 names) whose
per-expert weights are stored the same way: their experts load as FP8 (``Fp8Experts``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from libs.engine import LLM, EngineConfig, SamplingParams
from libs.model.fp8 import Fp8Linear
from libs.model.fp8_checkpoint import check_quantization_config
from libs.model.weights import read_hf_folder
from tests.checkpoints import save_tokenizer, write_checkpoint
from tests.models import CHAT_PROMPTS, RAW_PROMPTS, hf_gguf_tokenizer

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
UNALIGNED = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4, num_key_value_heads=2)
ALIGNED = dict(hidden_size=256, intermediate_size=384, num_attention_heads=4, num_key_value_heads=2)
IGNORED = "model.layers.1.mlp.down_proj"


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's block format, block by block: scale = amax / 448, q = w / scale."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    s = torch.empty(math.ceil(n / 128), math.ceil(k / 128))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s[i, j] = block.abs().max() / 448
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / s[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, s


def block_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * full


# Linear weights an FP8 checkpoint stores in e4m3: attention, dense MLPs, MoE experts and
# shared experts (Mixtral's w1/w2/w3 too); never norms, embeddings, the LM head or routers.
QUANTIZED = re.compile(r"model\.layers\.\d+\..*(_proj|\.w[123])\.weight")


def quantize_checkpoint(folder: Path, ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Rewrite a float checkpoint (written by transformers) in block FP8, as DeepSeek-V3 and
    vLLM store it; returns the dequantized weights by module name (what the file means)."""
    (shard,) = folder.glob("*.safetensors")
    state = safetensors_torch.load_file(str(shard))
    meaning = {}
    for key in [k for k in state if QUANTIZED.fullmatch(k)]:
        name = key.removesuffix(".weight")
        if name not in ignore:
            q, s = block_quantize(state[key])
            state[key], state[name + ".weight_scale_inv"] = q, s
            meaning[name] = block_dequantize(q, s)
    safetensors_torch.save_file(state, str(shard), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {**QUANT_CONFIG, "ignored_layers": list(ignore)}
    (folder / "config.json").write_text(json.dumps(config))
    return meaning


def write_fp8_checkpoint(folder: Path, tokenizer_dir: Path, dims: dict, ignore: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """A tiny Llama in FP8; returns the dequantized weights (what the checkpoint means)."""
    config = dict(num_hidden_layers=2, max_position_embeddings=512, tie_word_embeddings=True, **dims)
    write_checkpoint("LlamaConfig", "LlamaForCausalLM", config, folder, tokenizer_dir)
    return quantize_checkpoint(folder, ignore)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def unaligned(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("fp8-unaligned")
    return folder, write_fp8_checkpoint(folder, tokenizer_dir, UNALIGNED, ignore=(IGNORED,))


@pytest.fixture(scope="module")
def aligned(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("fp8-aligned")
    return folder, write_fp8_checkpoint(folder, tokenizer_dir, ALIGNED)


def engine_for(folder: Path, quantization: str = "auto") -> LLM:
    return LLM(EngineConfig(model=str(folder), device="cpu", dtype="float32", num_blocks=64, quantization=quantization))


def prompts() -> list[list[int]]:
    tok = hf_gguf_tokenizer()
    ids = [tok.encode(p, add_special_tokens=False) for p in RAW_PROMPTS[:3]]
    ids.append(tok.apply_chat_template(CHAT_PROMPTS[2], add_generation_prompt=True, tokenize=True, return_dict=False))
    return [list(map(int, x)) for x in ids]


def test_fp8_checkpoint_loads_its_values_exactly(unaligned):
    folder, meaning = unaligned
    llm = engine_for(folder)  # auto: the checkpoint says FP8
    assert llm.namespace.quantization == "fp8"
    for i, layer in enumerate(llm.loaded.model.layers):
        qkv = layer.self_attn.qkv_proj
        assert isinstance(qkv, Fp8Linear) and qkv.out_index is not None  # 192/96/96 rows: unaligned parts
        parts = [meaning[f"model.layers.{i}.self_attn.{x}_proj"] for x in "qkv"]
        assert torch.equal(qkv.weight.dequantize(), torch.cat(parts))
        gate_up = layer.mlp.gate_up_proj
        assert torch.equal(gate_up.weight.dequantize(), torch.cat([meaning[f"model.layers.{i}.mlp.{x}_proj"] for x in ("gate", "up")]))
        assert torch.equal(layer.self_attn.o_proj.weight.dequantize(), meaning[f"model.layers.{i}.self_attn.o_proj"])
    assert type(llm.loaded.model.layers[1].mlp.down_proj) is nn.Linear  # ignored_layers stay dense
    assert isinstance(llm.loaded.model.layers[0].mlp.down_proj, Fp8Linear)


def hf_model_with(folder: Path, meaning: dict[str, torch.Tensor]):
    """transformers' model of the checkpoint's meaning: its dequantized weights written as a
    float checkpoint beside it and read by ``from_pretrained`` (which maps every family's
    expert names to its own modules)."""
    dense = folder.parent / (folder.name + "-dense")
    if not dense.exists():
        shutil.copytree(folder, dense)
        (shard,) = dense.glob("*.safetensors")
        state = {k: v for k, v in safetensors_torch.load_file(str(shard)).items() if not k.endswith("_scale_inv")}
        state.update({k + ".weight": v for k, v in meaning.items()})
        safetensors_torch.save_file({k: v.float() for k, v in state.items()}, str(shard), metadata={"format": "pt"})
        config = json.loads((dense / "config.json").read_text())
        del config["quantization_config"]
        (dense / "config.json").write_text(json.dumps(config))
    return transformers.AutoModelForCausalLM.from_pretrained(str(dense), dtype=torch.float32).eval()


def hf_first_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0, -1].float()


def test_dequantized_fp8_checkpoint_matches_transformers(unaligned):
    """``--quantization none`` runs the checkpoint's meaning in float32: transformers'
    logits on the same dequantized weights, to 1e-4."""
    folder, meaning = unaligned
    llm = engine_for(folder, "none")
    assert llm.namespace.quantization == "none"
    assert not any(isinstance(m, Fp8Linear) for m in llm.loaded.model.modules())
    hf = hf_model_with(folder, meaning)
    for ids in prompts():
        assert torch.allclose(llm.first_step_logits(ids), hf_first_logits(hf, ids), atol=1e-4, rtol=0)


def test_fp8_run_of_the_checkpoint_is_transformers_with_quantized_activations(unaligned):
    """FP8 compute is W8A8: transformers on the checkpoint's dequantized weights, with every
    quantized projection's input quantized and dequantized per token group of 128 (the
    reference quantizer, tested against e4m3's bounds in test_fp8_kernels.py), gives our
    FP8 run's logits. Only fp32 summation order differs, and now and then an activation
    that lands a hair from a rounding midpoint (the two models' inputs differ in the last
    bit) rounds to the neighbouring e4m3 value."""
    folder, meaning = unaligned
    hf = hf_model_with(folder, meaning)
    for name, module in hf.named_modules():
        if name in meaning:
            module.register_forward_pre_hook(lambda _, args: (quantize_dequantize(args[0]),))
    fp8, dense = engine_for(folder), engine_for(folder, "none")
    for ids in prompts():
        ours, theirs, unquantized = fp8.first_step_logits(ids), hf_first_logits(hf, ids), dense.first_step_logits(ids)
        assert (ours - theirs).norm() < 1e-3 * (ours - unquantized).norm()  # measured ~4e-6


def quantize_dequantize(x: torch.Tensor) -> torch.Tensor:
    from kernels.fp8 import reference as ref

    flat = x.reshape(-1, x.shape[-1])
    q, s = ref.per_token_group_quant(flat)
    return ref.dequantize_activation(q, s)[: flat.shape[0], : flat.shape[1]].reshape(x.shape)


def test_transformers_reads_our_aligned_checkpoint_as_we_do(aligned):
    """transformers' FineGrainedFP8 reader (dequantizing on the CPU) is an independent reader
    of the same files: its model and ours with ``--quantization none`` agree."""
    folder, _ = aligned
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    llm = engine_for(folder, "none")
    for ids in prompts()[:2]:
        assert torch.allclose(llm.first_step_logits(ids), hf_first_logits(hf, ids), atol=1e-4, rtol=0)
    assert engine_for(folder).namespace.quantization == "fp8"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"weight_block_size": None}, "per-tensor"),
        ({"weight_block_size": [64, 64]}, "64, 64"),
        ({"activation_scheme": "static"}, "static"),
        ({"fmt": "e5m2"}, "e5m2"),
        ({"quant_method": "awq"}, "awq"),
    ],
)
def test_unsupported_quantization_configs_fail_clearly(change, message):
    qc = {k: v for k, v in {**QUANT_CONFIG, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        check_quantization_config({"quantization_config": qc})
    assert check_quantization_config({}) is False and check_quantization_config({"quantization_config": QUANT_CONFIG})


def test_broken_fp8_checkpoints_fail_at_load(unaligned, tmp_path):
    folder, _ = unaligned
    (shard,) = folder.glob("*.safetensors")
    state = safetensors_torch.load_file(str(shard))
    config = json.loads((folder / "config.json").read_text())

    def write(state: dict, config: dict) -> Path:
        d = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        safetensors_torch.save_file(state, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config))
        return d

    no_qc = {k: v for k, v in config.items() if k != "quantization_config"}
    with pytest.raises(ValueError, match="no fp8 quantization_config"):
        read_hf_folder(write(state, no_qc))
    missing = {k: v for k, v in state.items() if k != "model.layers.0.mlp.up_proj.weight_scale_inv"}
    with pytest.raises(ValueError, match="up_proj.weight_scale_inv"):
        read_hf_folder(write(missing, config))
    wrong_grid = {**state, "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ValueError, match="block grid"):
        read_hf_folder(write(wrong_grid, config))


QWEN2_MOE = dict(  # a shared expert, and a dense layer (1) among sparse ones
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    intermediate_size=112, moe_intermediate_size=48, num_experts=6, num_experts_per_tok=2,
    shared_expert_intermediate_size=80, norm_topk_prob=False, mlp_only_layers=[1], tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("qwen2-moe")
    write_checkpoint("Qwen2MoeConfig", "Qwen2MoeForCausalLM", QWEN2_MOE, folder, tokenizer_dir)
    return folder


def test_moe_models_run_experts_in_fp8_and_routers_dense(moe_folder, tmp_path):
    """FP8 covers attention, dense MLPs, the shared expert (Fp8Linear) and the experts
    (``Fp8Experts``: e4m3 with 128x128 block scales per expert); routers stay in the model's
    dtype. Quantized at load or read from an FP8 checkpoint in the DeepSeek-V3 /
    Qwen3-MoE-FP8 layout (per-expert ``experts.{e}.*_proj.weight`` e4m3 + ``weight_scale_inv``,
    written here by an independent block loop), the experts are the same bytes and the
    model the same logits."""
    from libs.model.fp8 import Fp8Experts
    from libs.model.moe import select_topk
    from libs.model.moe.block import SparseMoeBlock

    at_load = engine_for(moe_folder, "fp8")
    fp8 = at_load.loaded.model
    moe, dense_mlp = fp8.layers[0].mlp, fp8.layers[1].mlp
    assert isinstance(moe, SparseMoeBlock) and isinstance(moe.w13, Fp8Experts) and isinstance(moe.w2, Fp8Experts)
    assert moe.w13.q.dtype == moe.w2.q.dtype == torch.float8_e4m3fn
    assert moe.w13.q.shape == (6, 2 * 128, 128) and moe.w2.q.shape == (6, 128, 128)  # I 48 and H 64, each padded
    assert isinstance(moe.shared_expert.gate_up_proj, Fp8Linear) and isinstance(moe.shared_expert.down_proj, Fp8Linear)
    assert type(moe.gate) is nn.Linear and type(moe.shared_expert_gate) is nn.Linear
    assert all(isinstance(layer.self_attn.qkv_proj, Fp8Linear) for layer in fp8.layers)
    assert isinstance(dense_mlp.gate_up_proj, Fp8Linear) and isinstance(dense_mlp.down_proj, Fp8Linear)

    folder = tmp_path / "qwen2-moe-fp8"
    shutil.copytree(moe_folder, folder)
    meaning = quantize_checkpoint(folder)
    assert "model.layers.0.mlp.experts.5.down_proj" in meaning and "model.layers.0.mlp.shared_expert.gate_proj" in meaning
    llm = engine_for(folder)
    assert llm.namespace.quantization == "fp8"
    model = llm.loaded.model
    block = model.layers[0].mlp
    assert isinstance(block.w13, Fp8Experts) and isinstance(block.shared_expert.gate_up_proj, Fp8Linear)
    for e in range(6):
        w13 = torch.cat([meaning[f"model.layers.0.mlp.experts.{e}.{x}_proj"] for x in ("gate", "up")])
        assert torch.equal(block.w13.dequantize()[e], w13) and torch.equal(block.w2.dequantize()[e], meaning[f"model.layers.0.mlp.experts.{e}.down_proj"])
    assert torch.equal(block.w13.q.view(torch.uint8), moe.w13.q.view(torch.uint8)) and torch.equal(block.w13.scale, moe.w13.scale)
    assert torch.equal(block.w2.q.view(torch.uint8), moe.w2.q.view(torch.uint8)) and torch.equal(block.w2.scale, moe.w2.scale)
    # The experts compute the same (the dense layers differ: a checkpoint's q/k/v and the
    # shared expert's gate/up keep each part's own blocks, quantized at load they are fused).
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(0))
    routing = select_topk(block.gate(x), 2, scoring="softmax", renormalize=False)
    with torch.no_grad():
        assert torch.equal(block.run_experts(x, routing), moe.run_experts(x, routing))
    assert isinstance(model.layers[1].mlp.down_proj, Fp8Linear)
    hf = hf_model_with(folder, meaning)
    dense = engine_for(folder, "none")
    for ids in prompts()[:2]:
        assert torch.allclose(dense.first_step_logits(ids), hf_first_logits(hf, ids), atol=1e-4, rtol=0)
        assert llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids


def test_mixtral_fp8_checkpoint_keeps_its_experts_in_fp8(tokenizer_dir, tmp_path):
    """Mixtral names its experts ``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down):
    read as FP8, with an intermediate size (96) that leaves each half of the fused gate/up
    padded on its own, and the same bytes as quantizing the float checkpoint at load."""
    from libs.model.fp8 import Fp8Experts
    from tests.unit.test_moe_models import CASES

    folder = tmp_path / "mixtral"
    write_checkpoint(*CASES["mixtral"], folder, tokenizer_dir)
    at_load = engine_for(folder, "fp8").loaded.model.layers[1].mlp
    meaning = quantize_checkpoint(folder)
    llm = engine_for(folder)
    block = llm.loaded.model.layers[1].mlp
    assert isinstance(block.w13, Fp8Experts) and block.w13.q.shape == (4, 2 * 128, 128) and block.w2.q.shape == (4, 128, 128)
    dense13, dense2 = block.w13.dequantize(), block.w2.dequantize()
    for e in range(4):
        p = f"model.layers.1.block_sparse_moe.experts.{e}."
        assert torch.equal(dense13[e], torch.cat([meaning[p + "w1"], meaning[p + "w3"]])) and torch.equal(dense2[e], meaning[p + "w2"])
    assert torch.equal(block.w13.q.view(torch.uint8), at_load.w13.q.view(torch.uint8)) and torch.equal(block.w2.scale, at_load.w2.scale)
    assert type(block.gate) is nn.Linear
    assert llm.generate([prompts()[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
