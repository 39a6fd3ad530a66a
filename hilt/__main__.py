import sys

from hilt.cli import main

sys.exit(main())
