"""``python -m asyncplane.probe``: the qualification probe's command."""

import sys

from asyncplane.probe._cli import main

sys.exit(main())
