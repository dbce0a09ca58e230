"""A small real service for stack tests: ``python -m tests.support.stack_service --port P --record FILE``.

It records what it was started with (argv, its environment's ``STACK_*`` variables and
``TIDELOG_SERVICE*``, pid and process group) as JSON in ``--record`` (the file named per service),
then serves ``GET /health`` (without ``--port`` it only runs): 200, or 503 until ``--ready-after`` seconds have passed. ``--exit``
exits at once with that code instead; ``--child`` starts a child process in its group that sleeps
(for the tests that look for leftovers).
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--bind", default="127.0.0.1", help="the address to serve on")
    p.add_argument("--record", required=True)
    p.add_argument("--ready-after", type=float, default=0.0)
    p.add_argument("--exit", type=int)
    p.add_argument("--child", action="store_true")
    p.add_argument("rest", nargs="*")
    args = p.parse_args()
    started = time.monotonic()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) if args.child else None
    record = {"argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgid(0), "child": child and child.pid,
              "env": {k: v for k, v in os.environ.items() if k.startswith(("STACK_", "TIDELOG_SERVICE"))}}
    tmp = args.record + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, args.record)
    print(f"service up: {sys.argv[1:]}", flush=True)
    if args.exit is not None:
        return args.exit

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            ok = time.monotonic() - started >= args.ready_after
            self.send_response(200 if ok else 503)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"not yet")

        def log_message(self, *_: object) -> None:
            pass

    if args.port is None:
        while True:  # no port: a worker that only runs
            time.sleep(60)
    http.server.HTTPServer((args.bind, args.port), Handler).serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
