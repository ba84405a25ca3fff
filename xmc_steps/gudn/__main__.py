from ..stage import cli_main
from .cli import main

raise SystemExit(cli_main(main))
