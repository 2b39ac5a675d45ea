import sys

from systems.workbook.cli import main

sys.exit(main())
