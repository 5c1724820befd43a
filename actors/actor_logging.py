"""raylm's INFO lines from inside a Ray process (an EngineCore or worker actor, a Serve
replica): the process's stderr, which Ray forwards to the driver's console. Python logging
in a Ray worker process shows warnings only otherwise, so the startup lines (the weights a
rank read, which path each quantized layer runs, the device a rank got) would be lost."""

from __future__ import annotations

import logging


def show_raylm_info_logs() -> None:
    """Once per process: the ``raylm`` loggers at INFO, to stderr."""
    raylm_logger = logging.getLogger("raylm")
    if raylm_logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    raylm_logger.addHandler(handler)
    raylm_logger.setLevel(logging.INFO)
    raylm_logger.propagate = False
