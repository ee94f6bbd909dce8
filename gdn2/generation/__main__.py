import sys

from gdn2.commandline import run
from gdn2.generation.cli import main

if __name__ == "__main__":
    sys.exit(run(main, sys.argv[1:], "gdn2 generate"))
