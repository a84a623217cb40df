"""The pipeline's passes, one per module; importing this package registers them all."""

from qwen2om.passes import (  # noqa: F401  (imported for registration)
    check_ascend,
    check_outputs,
    check_scales,
    check_weights,
    compile_ascend,
    export_onnx,
    fuse_attention,
    fuse_int4,
    fuse_moe,
    fuse_norm,
    legalize_ort,
    load_checkpoint,
    lower_fp8,
    lower_int4,
    lower_int4_ascend,
    lower_topk_ascend,
    package,
    scale_inputs,
    static_model,
    write_onnx,
)
