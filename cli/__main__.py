import sys

from jaxserve.cli.main import main

sys.exit(main())
