"""Handler factories for tests of llama_cpp.run_isolated: children that die or hang like a broken engine."""

from __future__ import annotations

import os
import time


def aborting():
    def handle(header, payload):
        os.abort()

    return handle


def hanging():
    def handle(header, payload):
        time.sleep(3600)

    return handle
