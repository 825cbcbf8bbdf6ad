import sys

from saffu.cli import main

sys.exit(main())
