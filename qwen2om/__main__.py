from qwen2om.cli import main

main()
