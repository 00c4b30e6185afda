"""Health probes for the air-gapped infrastructure (the RobustRL image has no wget/redis-cli).

Usage: ``python probe.py nats|redis|s3``; exit status 0 means healthy. Credentials are read from
the same container environment the server itself uses. Every probe has a short timeout so a
wedged server fails the health check instead of hanging it.
"""

from __future__ import annotations

import os
import socket
import sys
import urllib.request

TIMEOUT_S = 2.0


def nats() -> bool:
    url = "http://127.0.0.1:8222/healthz?js-enabled-only=true"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as resp:
        return resp.status == 200


def redis() -> bool:
    password = os.environ["REDIS_PASSWORD"]
    with socket.create_connection(("127.0.0.1", 6379), timeout=TIMEOUT_S) as conn:
        # RESP arrays, so a password with spaces or quotes is sent intact.
        auth = f"*2\r\n$4\r\nAUTH\r\n${len(password.encode())}\r\n{password}\r\n*1\r\n$4\r\nPING\r\n"
        conn.sendall(auth.encode())
        reply = b""
        while b"PONG" not in reply and b"-" not in reply and len(reply) < 4096:
            chunk = conn.recv(1024)
            if not chunk:
                break
            reply += chunk
        return b"+PONG" in reply


def s3() -> bool:
    from minio import Minio
    from urllib3 import PoolManager, Timeout

    client = Minio("127.0.0.1:9000", access_key=os.environ["MINIO_ROOT_USER"],
                   secret_key=os.environ["MINIO_ROOT_PASSWORD"], secure=False,
                   http_client=PoolManager(timeout=Timeout(TIMEOUT_S), retries=False))
    client.list_buckets()
    return True


PROBES = {"nats": nats, "redis": redis, "s3": s3}

if __name__ == "__main__":
    try:
        ok = PROBES[sys.argv[1]]()
    except Exception as exc:  # noqa: BLE001 - any failure is "unhealthy"
        print(f"unhealthy: {exc}", file=sys.stderr)
        ok = False
    sys.exit(0 if ok else 1)
