"""``python -m stronghold_hf SCRIPT [ARGS...]``: see `stronghold_hf.launcher`."""

import sys

from .launcher import main

if __name__ == "__main__":
    sys.exit(main())
