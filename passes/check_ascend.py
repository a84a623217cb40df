"""Stop an Ascend conversion before anything is written if ATC would reject the graphs."""

from __future__ import annotations

from typing import ClassVar

from qwen2om.ascend import check_or_raise, problems, soc_info
from qwen2om.pipeline import PassResult, RunContext, Workspace, register


@register
class CheckAscend:
    """The legality checker (qwen2om/ascend.py) over every graph: one error listing every problem."""

    name: ClassVar[str] = "check_ascend"
    requires: ClassVar[tuple[str, ...]] = ("graphs", "legal_graphs")
    produces: ClassVar[tuple[str, ...]] = ("ascend_checked",)

    def __call__(self, ws: Workspace, ctx: RunContext) -> PassResult:
        graphs = ws.need("graphs")
        soc = soc_info(ctx.recipe.soc_version)
        check_or_raise(graphs, soc)
        ws["ascend_checked"] = True
        nodes = sum(len(list(m.graph)) for m in graphs.values())
        return PassResult(False, {"graphs": len(graphs), "nodes_checked": nodes,
                                  "problems": sum(len(problems(m, soc)) for m in graphs.values())})
