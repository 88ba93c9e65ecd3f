"""Mixture-of-experts layers: routing, the sparse block, expert executors, expert parallelism.

| module | concept |
|---|---|
| ``routing.py`` | ``select_topk`` (the router's pure op) and ``FakeBalanceExpert`` |
| ``block.py`` | ``SparseMoeBlock``: router → experts (+ shared expert); HF weight names |
| ``executors.py`` | loop / contiguous / masked / hybrid / grouped_mm expert executors |
| ``strategy.py`` | capability checks (never raise) and the executor choice; hybrid threshold data |
| ``dispatch.py`` | experts here, or dispatched and combined over an EP group by all-to-all |
| ``options.py`` | ``MoEOptions``: strategy, fake balance, EP group |

The kernels (ep_scatter, combine, grouped GEMMs) are in ``kernels/moe``; process groups in
``libs/dist``.
"""

from libs.model.moe.options import STRATEGIES, MoEOptions
from libs.model.moe.routing import FakeBalanceExpert, Routing, select_topk

__all__ = ["STRATEGIES", "FakeBalanceExpert", "MoEOptions", "Routing", "select_topk"]
