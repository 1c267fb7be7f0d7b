"""Mount kvfs: `python mount_kvfs.py MOUNTPOINT [--data DIR] [--capacity SIZE] ...`."""

import sys

from kvfs.cli.main import mount_main

if __name__ == "__main__":
    sys.exit(mount_main())
