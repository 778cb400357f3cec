import sys

from ggraph.cli import main

sys.exit(main())
