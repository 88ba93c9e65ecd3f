"""A pruned draft vocabulary: the draft's LM head restricted to the target's most frequent tokens.

A small draft spends much of its time in its LM head (SmolLM2-135M's is 49152 x 576: as
many multiply-adds as five of its 30 layers), yet most of that vocabulary almost never
comes up. EAGLE-3 and seed 001 restrict the draft head to the ``N`` most frequent target
tokens. The maps use EAGLE-3's format:

- ``d2t``: ``[N]`` int64 offsets, draft id ``j`` is target id ``j + d2t[j]``;
- ``t2d``: ``[V]`` bool, whether a target id is in the draft vocabulary.

Draft ids are ordered by target id, so ``d2t`` is non-decreasing. The draft samples over
its ``N`` ids, and both its draft token and its probabilities are mapped into the target
vocabulary *before* anything downstream sees them (``to_target_ids``, ``to_target_probs``):
the target is fed target ids, and the rejection sampler compares ``p`` and ``q`` over the
same vocabulary, with ``q = 0`` outside the draft's ``N`` tokens (seed 001 applied its map
in the wrong place). The target's EOS tokens are always kept, so a draft can propose the end.

Building one (a token-frequency count over a corpus, or over the model's own generations)::

    python -m libs.engine.spec.vocab --size 8192 --corpus docs/*.txt --out vocab.safetensors
    python -m libs.engine.spec.vocab --size 8192 --generate prompts.txt --max-tokens 256 --out vocab.safetensors
    tidepool spec-vocab ...   # the same command

``--generate`` reads one prompt per line (chat-rendered) and counts the tokens the target
itself samples from them (temperature 1 by default), which is what a draft must predict.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class DraftVocab:
    target_ids: torch.Tensor  # [N] int64, increasing: the target id of each draft id
    target_vocab_size: int

    def __post_init__(self) -> None:
        ids = self.target_ids
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError("a draft vocabulary needs at least one token")
        if int(ids.min()) < 0 or int(ids.max()) >= self.target_vocab_size:
            raise ValueError(f"draft vocabulary maps outside the target vocabulary [0, {self.target_vocab_size})")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError("draft vocabulary target ids must be strictly increasing")

    @property
    def size(self) -> int:
        return self.target_ids.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.target_ids - torch.arange(self.size, device=self.target_ids.device)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.target_ids.device)
        mask[self.target_ids] = True
        return mask

    def to(self, device: torch.device | str) -> "DraftVocab":
        return DraftVocab(self.target_ids.to(device), self.target_vocab_size)

    # -- mapping (draft -> target) -------------------------------------------------------------

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.target_ids[draft_ids]

    def to_target_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """``[..., N]`` over the draft vocabulary → ``[..., V]`` over the target's (zeros elsewhere)."""
        out = draft_probs.new_zeros((*draft_probs.shape[:-1], self.target_vocab_size))
        out.index_copy_(out.dim() - 1, self.target_ids, draft_probs)
        return out

    def prune_head(self, head_weight: torch.Tensor) -> torch.Tensor:
        """The LM head's rows of the draft vocabulary (a copy: ``[N, hidden]``)."""
        return head_weight[self.target_ids.to(head_weight.device)].contiguous()

    # -- building, saving, loading ----------------------------------------------------------------

    @classmethod
    def from_counts(cls, counts: torch.Tensor, size: int, *, always: Iterable[int] = ()) -> "DraftVocab":
        """The ``size`` most frequent ids of ``counts`` (``[V]``), plus ``always`` (EOS)."""
        V = counts.numel()
        if not 1 <= size <= V:
            raise ValueError(f"size must be in [1, {V}], got {size}")
        keep = set(int(t) for t in always if 0 <= int(t) < V)
        # By count, ties by id (a stable sort), so the same counts always give the same vocab.
        order = np.argsort(-counts.cpu().numpy().astype(np.int64), kind="stable")
        for t in order[: size + len(keep)].tolist():
            if len(keep) >= size:
                break
            keep.add(t)
        return cls(torch.tensor(sorted(keep), dtype=torch.long), V)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({"d2t": self.d2t.cpu().contiguous(), "t2d": self.t2d.cpu().to(torch.uint8)}, str(path))

    @classmethod
    def load(cls, path: str | Path, target_vocab_size: int) -> "DraftVocab":
        from safetensors.torch import load_file

        try:
            tensors = load_file(str(path))
        except FileNotFoundError:
            raise ValueError(f"draft vocabulary file {str(path)!r} does not exist") from None
        except Exception as e:  # noqa: BLE001 - a corrupt or foreign file
            raise ValueError(f"draft vocabulary file {str(path)!r} is unreadable: {e}") from None
        if "d2t" not in tensors or "t2d" not in tensors:
            raise ValueError(f"draft vocabulary file {str(path)!r} needs tensors d2t and t2d")
        d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
        if t2d.numel() != target_vocab_size:
            raise ValueError(f"draft vocabulary was built for a vocabulary of {t2d.numel()} tokens, the target has {target_vocab_size}")
        vocab = cls(d2t + torch.arange(d2t.numel()), target_vocab_size)
        if not torch.equal(vocab.t2d, t2d):
            raise ValueError(f"draft vocabulary file {str(path)!r}: d2t and t2d disagree")
        return vocab


def count_tokens(texts: Iterable[str], encode, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for text in texts:
        ids = torch.tensor(encode(text), dtype=torch.long)
        if ids.numel():
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def count_generations(llm, prompts: Sequence[str], *, max_tokens: int, temperature: float, seed: int) -> torch.Tensor:
    """Token counts of what the target itself generates from chat-rendered ``prompts``."""
    from libs.engine.params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in range(len(prompts))]
    results = llm.generate(messages=[[{"role": "user", "content": p}] for p in prompts], params=params)
    counts = torch.zeros(llm.vocab_size, dtype=torch.long)
    for r in results:
        if r.token_ids:
            counts += torch.bincount(torch.tensor(r.token_ids), minlength=llm.vocab_size)[: llm.vocab_size]
    return counts


def _tokenizer_and_vocab_size(model: str | None):
    """The target's tokenizer and its model's vocabulary size (what the maps index),
    reading a GGUF's metadata once (the reader is the slow part)."""
    from libs.model import load_config, load_tokenizer
    from libs.model.source import resolve_model_path

    path = resolve_model_path(model)
    if not path.is_file():
        return load_tokenizer(path), load_config(path).vocab_size
    from libs.model.gguf_file import read_gguf_file
    from libs.model.gguf_meta import gguf_config
    from libs.model.tokenizer import Tokenizer

    meta = read_gguf_file(path).metadata
    return Tokenizer.from_gguf_fields(meta), gguf_config(meta).vocab_size


def build_parser(prog: str = "python -m libs.engine.spec.vocab") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Build a pruned draft vocabulary (d2t/t2d) from token frequencies.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", nargs="+", metavar="FILE", help="text files to tokenize and count")
    src.add_argument("--generate", metavar="PROMPTS", help="a file of prompts, one per line: count the target's own generations")
    p.add_argument("--size", type=int, required=True, help="draft vocabulary size N (EOS tokens are always included)")
    p.add_argument("--out", required=True, help="output .safetensors file (d2t, t2d)")
    p.add_argument("--model", default=None, help="the target model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=256, help="--generate: tokens per prompt (default 256)")
    p.add_argument("--temperature", type=float, default=1.0, help="--generate: sampling temperature (default 1)")
    p.add_argument("--seed", type=int, default=0, help="--generate: base seed (default 0)")
    p.add_argument("--device", default="auto", help="--generate: cpu, cuda or auto")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "python -m libs.engine.spec.vocab") -> int:
    args = build_parser(prog).parse_args(argv)
    try:
        texts = [Path(f).read_text(encoding="utf-8", errors="replace") for f in args.corpus or ()]
        tok, vocab_size = _tokenizer_and_vocab_size(args.model)
        if args.corpus:
            counts = count_tokens(texts, lambda t: tok.encode(t, add_special_tokens=False), vocab_size)
        else:
            from libs.engine import LLM, EngineConfig

            prompts = [line.strip() for line in Path(args.generate).read_text().splitlines() if line.strip()]
            if not prompts:
                raise ValueError(f"{args.generate}: no prompts")
            llm = LLM(EngineConfig(model=args.model, device=args.device))
            try:
                counts = count_generations(llm, prompts, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
            finally:
                llm.close()
        vocab = DraftVocab.from_counts(counts, args.size, always=tok.eos_token_ids)
        vocab.save(args.out)
    except (OSError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    covered = float(counts[vocab.target_ids].sum()) / max(1, int(counts.sum()))
    print(f"wrote {args.out}: {vocab.size} of {vocab.target_vocab_size} tokens, covering {covered:.1%} of {int(counts.sum())} counted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
