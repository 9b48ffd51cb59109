"""``python -m upipe_dtensor.tokenize``: tokenize a job's training text once into a token folder,
which training memory-maps instead of tokenizing (``[training] dataset_path`` = the folder).

The command lives in ``upipe_dtensor.data.tokenize``; this module is its name on the command line.
"""

import sys

from upipe_dtensor.data.tokenize import main
from upipe_dtensor.runtime.errors import end_process

if __name__ == "__main__":
    end_process(main(sys.argv[1:]))
