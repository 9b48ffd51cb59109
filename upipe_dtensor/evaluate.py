"""``python -m upipe_dtensor.evaluate``: evaluate a job's weights on held-out token sequences (loss
by position).

The command lives in ``upipe_dtensor.jobs.evaluate``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.jobs.evaluate import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
