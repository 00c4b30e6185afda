"""A trainer that finds committed steps and no loadable checkpoint (controller tests): it says so
and exits with EXIT_CHECKPOINT_LOST, as services/trainer/worker.py does."""

import sys

from robustrl.errors import EXIT_CHECKPOINT_LOST

print("CheckpointLost: step 7 is committed but no checkpoint at or below it verifies", file=sys.stderr, flush=True)
sys.exit(EXIT_CHECKPOINT_LOST)
