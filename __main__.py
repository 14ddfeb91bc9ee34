"""``python -m tritonspec``: the same command line as the ``tritonspec`` console script."""

from .cli import main

raise SystemExit(main())
