import sys

from ampaudit.cli.main import main

sys.exit(main())
