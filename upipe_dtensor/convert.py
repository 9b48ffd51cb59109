"""``python -m upipe_dtensor.convert``: convert weights between our DCP snapshots and Hugging Face
folders.

The command lives in ``upipe_dtensor.jobs.convert``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.jobs.convert import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
