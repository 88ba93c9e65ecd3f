"""How a model's MoE layers run: the expert strategy, FakeBalanceExpert, expert parallelism.

These are runtime choices (``EngineConfig.moe_strategy``, ``moe_fake_balance``), not part
of the checkpoint; the architecture (experts, top-k, scoring) is ``ModelConfig.moe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libs.dist.groups import Group

# auto: the strategy module picks (hybrid on CUDA with Triton, the per-expert loop elsewhere).
STRATEGIES = ("auto", "loop", "contiguous", "masked", "hybrid", "grouped_mm")


@dataclass(frozen=True)
class MoEOptions:
    """``strategy``: how experts are computed (libs/model/moe/strategy.py). ``fake_balance``:
    replace real routing by FakeBalanceExpert (benchmarks only). ``ep``: the expert-parallel
    group this process belongs to (libs/dist); None keeps every expert here."""

    strategy: str = "auto"
    fake_balance: bool = False
    ep: "Group | None" = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown moe_strategy {self.strategy!r}; use one of {', '.join(STRATEGIES)}")
