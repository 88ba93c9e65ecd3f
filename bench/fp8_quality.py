"""FP8 weights' quality on the real SmolLM2-135M, on the CPU, against float32.

Figures (the issue's acceptance bounds in brackets), all from the same engines:

- greedy agreement over the engine-core prompts (tests/models.py: RAW_PROMPTS +
  CHAT_PROMPTS, the ones test_engine_correctness checks against transformers), 32 greedy
  tokens each [>= 90%], measured two ways:
  - per token (teacher-forced): at each of float32's 32 greedy positions, FP8's greedy
    choice given the same prefix; the share that agree;
  - free-running: each model generates on its own and the share of positions holding the
    same token; one early difference changes everything after it, so this mostly says
    where the first near-tie fell (``--calibrate`` runs bfloat16 through the same
    measure: even its 8-bit mantissa agrees with float32 on only ~70% this way);
- perplexity of a fixed text (``TEXT``) under each model, and the ratio [within 2%].

On the CPU the FP8 weights run through the dequantize-then-matmul reference, activations
quantized per token group exactly as the GPU kernels do, so these are FP8's numbers
(W8A8 with 128 x 128 weight blocks), not a CPU approximation of them.

    python -m bench.fp8_quality [--calibrate] [--out bench/results/fp8_quality.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from libs.engine import LLM, EngineConfig, SamplingParams
from libs.model.attention import AttentionMetadata

N_TOKENS = 32
# A fixed, public-domain text (the opening of "A Tale of Two Cities", 1859).
TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for good "
    "or for evil, in the superlative degree of comparison only. There were a king with a large jaw "
    "and a queen with a plain face, on the throne of England; there were a king with a large jaw and "
    "a queen with a fair face, on the throne of France. In both countries it was clearer than "
    "crystal to the lords of the State preserves of loaves and fishes, that things in general were "
    "settled for ever."
)


def engine_prompts(llm: LLM) -> list[list[int]]:
    from tests.models import CHAT_PROMPTS, RAW_PROMPTS

    tok = llm.tokenizer
    return [tok.encode(p) for p in RAW_PROMPTS] + [tok.encode_chat(m) for m in CHAT_PROMPTS]


def greedy(llm: LLM, prompts: list[list[int]], n: int = N_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [r.token_ids for r in llm.generate(prompts, params)]


def agreement(ours: list[list[int]], ref: list[list[int]]) -> tuple[float, float]:
    """(positions equal / all positions, common-prefix tokens / all positions)."""
    total = sum(len(r) for r in ref)
    same = sum(a == b for o, r in zip(ours, ref) for a, b in zip(o, r))
    prefix = 0
    for o, r in zip(ours, ref):
        for a, b in zip(o, r):
            if a != b:
                break
            prefix += 1
    return same / total, prefix / total


@torch.inference_mode()
def sequence_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    """fp32 logits ``[T, vocab]`` after every token: one prefill of the whole sequence
    through the model, on a KV cache of its own (the engine's runner binds its cache back
    before its next step)."""
    model, layout, device = llm.loaded.model, llm.layout, llm.device
    t = len(ids)
    blocks = -(-t // layout.block_size)
    model.bind_kv_cache(layout.allocate(blocks, device))
    model.kv_cache_owner = None
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=device),
        block_tables=torch.arange(blocks, **i32)[None],
        seq_lens=torch.tensor([t], **i32),
        query_start_loc=torch.tensor([0, t], **i32),
        num_decodes=0,
        num_prefill_tokens=t,
        max_seq_len=t,
    )
    hidden = model(torch.tensor(ids, device=device), torch.arange(t, device=device), meta)
    return model.compute_logits(hidden).float()


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], ref: list[list[int]]) -> float:
    """Share of the reference's greedy tokens that ``llm`` also picks given the same prefix."""
    same = total = 0
    for prompt, cont in zip(prompts, ref):
        logits = sequence_logits(llm, prompt + cont)[len(prompt) - 1 : len(prompt) - 1 + len(cont)]
        same += sum(a == b for a, b in zip(logits.argmax(-1).tolist(), cont))
        total += len(cont)
    return same / total


def token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Log-probability of each token after the first given those before it."""
    logits = sequence_logits(llm, ids)[:-1]
    return F.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:], device=logits.device)[:, None])[:, 0]


def perplexity(llm: LLM, text: str = TEXT) -> float:
    return math.exp(-token_logprobs(llm, llm.tokenizer.encode(text)).mean().item())


def measure(fp32: LLM, other: LLM) -> dict:
    prompts = engine_prompts(fp32)
    ref, ours = greedy(fp32, prompts), greedy(other, prompts)
    positions, prefix = agreement(ours, ref)
    ppl32, ppl = perplexity(fp32), perplexity(other)
    return {
        "prompts": len(prompts),
        "tokens_per_prompt": N_TOKENS,
        "greedy_agreement_per_token": teacher_forced_agreement(other, prompts, ref),
        "greedy_agreement_free_running": positions,
        "greedy_agreement_common_prefix": prefix,
        "perplexity_fp32": ppl32,
        "perplexity": ppl,
        "perplexity_ratio": ppl / ppl32,
        "text_tokens": len(fp32.tokenizer.encode(TEXT)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the figures as JSON here too")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calibrate", action="store_true", help="also measure bfloat16 the same way (a scale for the figures)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t = time.time()
    fp32 = LLM(EngineConfig(device="cpu", num_blocks=512))
    result = {"fp8": measure(fp32, LLM(EngineConfig(device="cpu", num_blocks=512, quantization="fp8")))}
    if args.calibrate:
        result["bfloat16"] = measure(fp32, LLM(EngineConfig(device="cpu", num_blocks=512, dtype="bfloat16")))
    result["seconds"] = round(time.time() - t, 1)
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
