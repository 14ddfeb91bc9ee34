"""``python -m tritonspec.recipes.demo``: run the demo recipe (see ``build``)."""

import sys

from .build import main

sys.exit(main())
