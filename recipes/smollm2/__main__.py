"""``python -m tritonspec.recipes.smollm2``: run the SmolLM2 recipe (see ``build``)."""

import sys

from .build import main

sys.exit(main())
