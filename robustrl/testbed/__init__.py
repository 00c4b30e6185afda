"""A multi-host testbed of network namespaces with shaped links and real network faults.

``Testbed`` builds and removes one (``robustrl.testbed.testbed``); ``sweep`` removes those whose
owner died (``robustrl.testbed.teardown``); the tc trees and fault filters are built in
``robustrl.testbed.links``.
"""

from robustrl.errors import TestbedError, TestbedUnavailable
from robustrl.testbed.state import HostInfo, TestbedState
from robustrl.testbed.teardown import SweepReport, leftovers, sweep
from robustrl.testbed.testbed import CutMode, Status, Testbed

__all__ = ["CutMode", "HostInfo", "Status", "SweepReport", "Testbed", "TestbedError", "TestbedState",
           "TestbedUnavailable", "leftovers", "sweep"]
