"""``python -m upipe_dtensor.integrations.torchtitan``: torchtitan's own ``main`` with the
installed generation's plug-in (0.2.2: its checks, then its ``UPipeTrainer``; 0.3.0: the
``--config`` function's trainer, as ``-m torchtitan.train``)."""

import sys

from upipe_dtensor.integrations import torchtitan as plugin
from upipe_dtensor.runtime.errors import end_process

end_process(plugin.main(sys.argv[1:]))
