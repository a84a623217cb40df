"""Stop an Ascend conversion before anything is written if ATC would reject the graphs."""

from __future__ import annotations

from typing import ClassVar

from qwen2om.ascend import check_or_raise, problems, soc_info
from qwen2om.pipeline import ConvertState, PassResult, RunContext, register


@register
class CheckAscend:
    """The legality checker (qwen2om/ascend.py) over every graph: one error listing every problem."""

    name: ClassVar[str] = "check_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "graphs_legal", "signatures", "topk_lowered")
    produces: ClassVar[tuple[str, ...]] = ("ascend_checked",)
    freezes: ClassVar[tuple[str, ...]] = ("graphs", "signatures")

    def __call__(self, state: ConvertState, ctx: RunContext) -> PassResult:
        graphs = state.graphs
        soc = soc_info(ctx.recipe.soc_version)
        check_or_raise(graphs, soc)
        nodes = sum(len(list(m.graph)) for m in graphs.values())
        return PassResult(False, {"graphs": len(graphs), "nodes_checked": nodes,
                                  "problems": sum(len(problems(m, soc)) for m in graphs.values())})
