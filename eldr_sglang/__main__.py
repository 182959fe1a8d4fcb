import sys

from eldr_sglang.cli import main

sys.exit(main())
