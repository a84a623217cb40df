from qwen2om.srcroot import leave_source_root

leave_source_root()  # before anything imports transformers (see qwen2om/srcroot.py)

from qwen2om.cli import main  # noqa: E402

main()
