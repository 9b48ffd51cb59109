"""``torchrun --nproc_per_node N -m upipe_dtensor.gpu_check``: a user's first GPU run, every
style against the unsharded model in bf16 and one step of the 8B shape beside the planner's
prediction, printed as one table to paste into an issue.

The command lives in ``upipe_dtensor.jobs.gpu_check``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.jobs.gpu_check import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
