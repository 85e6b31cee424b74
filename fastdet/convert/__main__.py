import sys

from fastdet.convert import main

sys.exit(main())
