"""``python -m upipe_dtensor.data_report``: the training data mixture as the job will train on it
(tokens per source before and after upsampling, document lengths), before training.

The command lives in ``upipe_dtensor.data.report``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.data.report import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
