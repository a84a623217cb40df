"""Which Ascend SoCs have a kernel for each fused NPU op qwen2om emits: data, with its source.

An ONNX node in the `npu` domain parses on any SoC (the parser plugin registers it), but ATC then
needs the op's kernel for the chosen SoC and the node's dtypes: each op's op-info config in CANN's
ops repositories (`op_host/<op>_def.cpp`, `AddConfig("ascend910b", ...)`) lists the SoCs and the
dtype combinations it has. Those lists are in the shipped table (qwen2om/data/cann-onnx-ops.json,
`_constraints.ops["<op>"].params.kernels`, keyed by the op-info config name, with file@commit#line
in `lines`), so the fusion passes ask here before emitting an op and the allow-list checker
(qwen2om/cann.py) refuses a node whose SoC has no kernel for it.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx_ir as ir

from qwen2om.ascend import Soc
from qwen2om.cann import CannTable, load_table

NPU_DOMAIN = "npu"


def missing_kernel(op: str, soc: Soc, dtypes: Mapping[str, ir.DataType | None],
                   table: CannTable | None = None) -> str | None:
    """None when `soc` has a kernel of npu::`op` taking these input dtypes ({input name: dtype}, as
    the op-info config names its inputs); else why not, citing the config it was read from."""
    table = table or load_table()
    rule = table.constraints.get(op)
    if rule is None:
        return f"the table has no op-info kernels for {op} ({table.path})"
    if refused := rule.get("params", {}).get("refused"):  # a kernel exists, but not one this graph can reach
        return f"{op} is not usable from ONNX: {refused} [{table.source(rule, 'plugin')}]"
    kernels = rule.get("params", {}).get("kernels", {})
    source = table.source(rule, "kernels")
    have = kernels.get(soc.kernels)
    if have is None:
        return (f"{soc.family} has no {op} kernel: its op-info config lists {', '.join(sorted(kernels)) or 'no SoC'}"
                + (f" [{source}]" if source else ""))
    # the op-info config's dtype columns: one combination per column, {input: dtype name}
    wanted = {name: d.name for name, d in dtypes.items() if d is not None}
    if not any(all(combo.get(name, d) == d for name, d in wanted.items()) for combo in have):
        shown = ", ".join(f"{k} {v}" for k, v in wanted.items())
        takes = "; ".join(", ".join(f"{k} {v}" for k, v in combo.items() if k in wanted) for combo in have)
        return (f"{soc.family}'s {op} kernel has no dtype combination {shown} (it takes: {takes})"
                + (f" [{source}]" if source else ""))
    return None
