"""One-shot compose job: create the RobustRL bucket on the object store if it is missing.

Runs in the RobustRL image (the ``minio`` client is a RobustRL dependency) against MinIO or, in
air-gapped mode, ``rclone serve s3``. Exits non-zero after a bounded number of attempts so that
``docker compose up`` reports the failure instead of waiting forever.
"""

from __future__ import annotations

import os
import sys
import time

from minio import Minio
from urllib3 import PoolManager, Timeout

ATTEMPTS = 30
PAUSE_S = 1.0


def main() -> int:
    bucket = os.environ.get("ROBUSTRL_S3_BUCKET", "robustrl")
    client = Minio(
        os.environ["ROBUSTRL_S3_ENDPOINT"],
        access_key=os.environ["ROBUSTRL_S3_ACCESS_KEY"],
        secret_key=os.environ["ROBUSTRL_S3_SECRET_KEY"],
        secure=os.environ.get("ROBUSTRL_S3_SECURE", "false").lower() == "true",
        http_client=PoolManager(timeout=Timeout(5.0), retries=False),
    )
    last: Exception | None = None
    for _ in range(ATTEMPTS):
        try:
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            print(f"bucket {bucket} ready")
            return 0
        except Exception as exc:  # noqa: BLE001 - the server may still be starting
            last = exc
            time.sleep(PAUSE_S)
    print(f"could not create bucket {bucket}: {last}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
