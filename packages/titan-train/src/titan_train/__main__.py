"""`python -m titan_train` is the `titan-train` command."""
import sys

from .cli import main

sys.exit(main())
