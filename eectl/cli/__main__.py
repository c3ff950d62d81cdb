"""`python -m eectl.cli` (torchrun and accelerate launch the CLI this way)."""

from eectl.cli import main

main()
