"""``python -m upipe_dtensor.plan``: the memory planner: will this recipe fit, what is the longest
context.

The command lives in ``upipe_dtensor.planning.cli``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.planning.cli import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
