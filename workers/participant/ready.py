"""A readiness check for a stack service that is a participant: exit 0 once it answers.

    python -m workers.participant.ready URL [--timeout S]

``GET URL/ng-control/v1/checkpoint/status`` with the control token (``TIDELOG_CONTROL_TOKEN``, read
from the environment only: a command line is readable by every user of the machine) must answer
200. Exit 0 then; 1 when it answers anything else or cannot be reached (why, on stderr, without the
token); 2 on a usage error. It imports only the standard library, so a check every fraction of a
second costs a few milliseconds of CPU, not an interpreter loading aiohttp.

Use it as a service's ``readiness: {command: [python, -m, workers.participant.ready,
"${endpoints.NAME}"]}`` with ``TIDELOG_CONTROL_TOKEN: "${env.TIDELOG_CONTROL_TOKEN}"`` in the
service's ``env`` (docs/deployment.md).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request

TOKEN_ENV = "TIDELOG_CONTROL_TOKEN"
STATUS_PATH = "/ng-control/v1/checkpoint/status"


def check(url: str, token: str, timeout: float) -> str | None:
    """``None`` when the participant at ``url`` answers its status with 200, else why not."""
    req = urllib.request.Request(url.rstrip("/") + STATUS_PATH, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return None if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m workers.participant.ready", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("url", help="the participant's base URL (http://host:port)")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds for the one request (default 2)")
    args = p.parse_args(argv)
    if not args.timeout > 0:
        p.error(f"--timeout must be > 0, not {args.timeout}")
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        print(f"{TOKEN_ENV} is not set: the status route needs the control token", file=sys.stderr)
        return 2
    why = check(args.url, token, args.timeout)
    if why is not None:
        print(f"{args.url}{STATUS_PATH}: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
