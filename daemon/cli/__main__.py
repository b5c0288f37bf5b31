"""`python -m daemon.cli ...` is `hotswap ...`."""

from daemon.cli.main import main

raise SystemExit(main())
