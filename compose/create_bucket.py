"""One-shot compose job: create the RobustRL bucket on the object store if it is missing, and the
per-role S3 users.

Runs in the RobustRL image (the ``minio`` client is a RobustRL dependency) against MinIO or, in
air-gapped mode, ``rclone serve s3``. Exits non-zero after a bounded number of attempts so that
``docker compose up`` reports the failure instead of waiting forever.

Per-role users (least privilege): on MinIO, the trainer's key (``S3_TRAINER_ACCESS_KEY``) may read and write the
bucket and the controller's (``S3_CONTROLLER_ACCESS_KEY``) only read it (MinIO policies, through its admin API). ``rclone serve s3``
has no admin API and no policies: there the two keys are extra ``--auth-key`` pairs with full
access (docs/operations.md), and this step only reports that.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from minio import Minio, MinioAdmin
from minio.credentials import StaticProvider
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
            create_role_users(bucket)
            return 0
        except Exception as exc:  # noqa: BLE001 - the server may still be starting
            last = exc
            time.sleep(PAUSE_S)
    print(f"could not create bucket {bucket}: {last}", file=sys.stderr)
    return 1


ROLE_USERS = {  # access-key variable -> (secret variable, allowed S3 actions on the bucket)
    "S3_TRAINER_ACCESS_KEY": ("S3_TRAINER_SECRET_KEY", ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                                  "s3:ListBucket", "s3:GetBucketLocation",
                                                  "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]),
    "S3_CONTROLLER_ACCESS_KEY": ("S3_CONTROLLER_SECRET_KEY", ["s3:GetObject", "s3:ListBucket", "s3:GetBucketLocation"]),
}


def create_role_users(bucket: str) -> None:
    """MinIO users for the roles that use S3, each with a policy on the job bucket only."""
    # Keywords only: minio >= 7.2.16 takes no positional arguments here (a positional endpoint raised
    # TypeError on every attempt and failed the compose stack's start).
    admin = MinioAdmin(endpoint=os.environ["ROBUSTRL_S3_ENDPOINT"],
                       credentials=StaticProvider(os.environ["ROBUSTRL_S3_ACCESS_KEY"],
                                                  os.environ["ROBUSTRL_S3_SECRET_KEY"]),
                       secure=os.environ.get("ROBUSTRL_S3_SECURE", "false").lower() == "true")
    for access_var, (secret_var, actions) in ROLE_USERS.items():
        access = os.environ[access_var]
        policy = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": [a for a in actions if a in ("s3:ListBucket", "s3:GetBucketLocation",
                                                                     "s3:ListBucketMultipartUploads")],
             "Resource": [f"arn:aws:s3:::{bucket}"]},
            {"Effect": "Allow", "Action": [a for a in actions if a not in ("s3:ListBucket", "s3:GetBucketLocation")],
             "Resource": [f"arn:aws:s3:::{bucket}/*"]}]}
        try:
            admin.user_add(access, os.environ[secret_var])
            with tempfile.NamedTemporaryFile("w", suffix=".json") as fh:
                json.dump(policy, fh)
                fh.flush()
                admin.policy_add(access, fh.name)
            admin.attach_policy([access], user=access)
        except Exception as exc:  # noqa: BLE001 - rclone serve s3 has no admin API
            print(f"no per-role S3 user {access} ({type(exc).__name__}): a server without policies "
                  "(rclone) takes the role keys as extra key pairs", file=sys.stderr)
            return
        print(f"S3 user {access} ready")


if __name__ == "__main__":
    sys.exit(main())
