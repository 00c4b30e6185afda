"""A stand-in member for the warm-spare test: reports who it became, then exits 3."""

import os
import sys

print(f"probe pid={os.getpid()} member={os.environ.get('ROBUSTRL_MEMBER_ID')} argv={sys.argv[1:]}", flush=True)
sys.exit(3)
