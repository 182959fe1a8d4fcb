import sys

from eldr_sglang.emulate import main

sys.exit(main())
