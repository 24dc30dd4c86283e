"""`python -m jaxspec.bench ...`: the `jaxspec-bench` command."""
import sys

from jaxspec.bench.cli import main

sys.exit(main())
