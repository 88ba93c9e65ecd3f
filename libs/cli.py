"""The ``tidepool`` command.

    tidepool generate --prompt "Once upon a time" --max-tokens 64
    tidepool generate --chat "What is the capital of France?" --temperature 0 --json
    tidepool generate --chat "..." --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    tidepool spec-vocab --size 8192 --corpus notes.txt --out vocab.safetensors

``generate`` streams the completion to the terminal as it is produced; with ``--json``
it prints one JSON object with ``prompt_token_ids``, ``token_ids`` and ``text`` instead
(and, with ``--speculative-config``, a ``spec_decode`` object: ``num_drafts``,
``num_draft_tokens``, ``num_accepted_tokens``). ``spec-vocab`` builds a pruned draft
vocabulary (libs/engine/spec/vocab.py).
Bad input (unknown model path, prompt too long, invalid sampling values) exits with
status 2 and a one-line error, before the model does any work.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from libs.engine import EngineConfig, InvalidRequestError, LLM, SamplingParams
from libs.engine.spec import parse_speculative_config
from libs.model import IncrementalDetokenizer, ModelNotFoundError
from libs.model.moe.options import STRATEGIES
from libs.model.weight_cache import resolve_cache_dir


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tidepool", description="Tidepool: LLM serving with a Redis-backed KV pool.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion offline and stream it to the terminal")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="a raw text prompt")
    src.add_argument("--chat", help="a user message, rendered with the model's chat template")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most (default 128)")
    g.add_argument("--temperature", type=float, default=1.0, help="0 for greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--device", default="auto", help="cpu, cuda or auto (default)")
    g.add_argument("--dtype", default="auto", help="float32, bfloat16 or auto (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--quantized", action="store_true", help="CPU + GGUF: decode with the file's 4-bit weights (faster, approximate)")
    g.add_argument("--packed-linears", action=argparse.BooleanOptionalAction, default=True, help="CPU float32: linear layers through oneDNN over weights packed at load (default on; off: torch's BLAS)")
    g.add_argument("--moe-strategy", default="auto", choices=STRATEGIES, help="MoE models: how experts run (default auto)")
    g.add_argument("--moe-fake-balance", action="store_true", help="MoE models: FakeBalanceExpert routing (load benchmarks only; changes the output)")
    g.add_argument(
        "--quantization", choices=("auto", "none", "fp8"), default="auto",
        help="fp8: block-scaled FP8 weights (quantized at load, or an FP8 checkpoint's); none: dense; auto (default): as the checkpoint is",
    )
    g.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="tensor-parallel ranks: one process each, started by this one (CUDA: GPUs cuda:k..k+N-1; CPU: gloo) (default 1)",
    )
    g.add_argument(
        "--tp-all-reduce", choices=("auto", "one_shot", "nccl"), default="auto",
        help="how tensor-parallel ranks sum partial outputs (default auto: small sums by a one-shot over GPU symmetric memory where available, else NCCL)",
    )
    g.add_argument(
        "--async-scheduling", choices=("auto", "on", "off"), default="auto",
        help="launch each step before the previous one's tokens are read back (default auto: on only where measured faster)",
    )
    g.add_argument(
        "--cache-dir", default="auto",
        help="where a GGUF's converted weights are cached and memory-mapped on the next run (a warm run skips "
        "conversion, as the services do); auto (default): $XDG_CACHE_HOME/tidepool or ~/.cache/tidepool; none: off",
    )
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    g.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, vLLM\'s JSON shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' (default: off)',
    )
    sub.add_parser("spec-vocab", help="build a pruned draft vocabulary for speculative decoding", add_help=False)
    return parser


def _generate(args: argparse.Namespace) -> int:
    # Validate sampling values before loading the model (fast, clear failure).
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, max_tokens=args.max_tokens
    )
    parse_speculative_config(args.speculative_config)  # a bad config fails before loading
    engine = LLM(EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, quantized_weights=args.quantized, packed_linears=args.packed_linears,
        moe_strategy=args.moe_strategy, moe_fake_balance=args.moe_fake_balance, quantization=args.quantization,
        tensor_parallel_size=args.tensor_parallel_size, tp_all_reduce=args.tp_all_reduce,
        async_scheduling=args.async_scheduling,
        speculative_config=args.speculative_config,
        weight_cache_dir=str(cache) if (cache := resolve_cache_dir(args.cache_dir)) else None,
    ))
    try:
        return _run(engine, args, params)
    finally:
        engine.close()  # under TP: stops the other ranks


def _run(engine: LLM, args: argparse.Namespace, params: SamplingParams) -> int:
    tok = engine.tokenizer
    if args.chat is not None:
        prompt_ids = tok.encode_chat([{"role": "user", "content": args.chat}])
    else:
        prompt_ids = tok.encode(args.prompt)
    engine.validate(prompt_ids, params)
    token_ids: list[int] = []
    detok = IncrementalDetokenizer(tok, prompt_ids)
    for new in engine.stream(prompt_ids, params):
        token_ids.extend(new)
        delta = detok.add(new)
        if not args.json and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
    tail = detok.flush()
    if args.json:
        result = {"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": tok.decode(token_ids)}
        if engine.spec is not None:
            m = engine.spec.metrics
            result["spec_decode"] = {"num_drafts": m.num_drafts, "num_draft_tokens": m.num_draft_tokens, "num_accepted_tokens": m.num_accepted_tokens}
        print(json.dumps(result))
    else:
        sys.stdout.write(tail + "\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["spec-vocab"]:
        from libs.engine.spec.vocab import main as spec_vocab

        return spec_vocab(argv[1:], prog="tidepool spec-vocab")
    args = _build_parser().parse_args(argv)
    try:
        return _generate(args)
    except (InvalidRequestError, ModelNotFoundError, ValueError) as e:
        print(f"tidepool: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
