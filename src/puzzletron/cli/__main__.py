import sys

from puzzletron.cli import main

sys.exit(main())
