"""`python -m keel.cli` (and `torchrun ... -m keel.cli`): the `keel` command."""

import sys

from keel.cli import main

sys.exit(main())
