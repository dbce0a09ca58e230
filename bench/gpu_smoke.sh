#!/usr/bin/env bash
# GPU smoke check of the SGLang adapter (workers/inference/sglang.py) against a real SGLang server.
#
# On a host with CUDA and SGLang installed it starts `python -m sglang.launch_server` with the
# reference model in Hugging Face format (workers/policy.py: written here, seed 0, beside a seed-1
# copy for the weight-update test) or TIDELOG_SGLANG_MODEL, and memory release enabled, waits for /health, runs tests/workers/inference against it
# (TIDELOG_SGLANG_URL; tests that need the reference engine's test routes skip, saying so), and
# stops the server. On a host without CUDA or without SGLang it says it cannot run and exits 0.
#
# Settings (environment):
#   PYTHON                         interpreter (default: .venv/bin/python, else python3)
#   TIDELOG_SGLANG_MODEL           model path or hub id (default: the reference model, written here)
#   TIDELOG_SGLANG_OTHER_MODEL     optional second checkpoint of the same architecture, so the
#                                  weight-update test also checks that generations change (default
#                                  with the reference model: its seed-1 copy)
#   TIDELOG_SGLANG_PORT            port (default: a free one)
#   TIDELOG_SGLANG_START_TIMEOUT   seconds to wait for /health (default 600)
#   TIDELOG_SGLANG_EXTRA_ARGS      extra launch_server arguments
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [[ -z "$PY" ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "gpu_smoke: cannot run here: no CUDA device visible to $PY (torch.cuda.is_available() is false or torch is missing); nothing checked"
  exit 0
fi
if ! "$PY" -c 'import sglang' >/dev/null 2>&1; then
  echo "gpu_smoke: cannot run here: SGLang is not installed for $PY (pip install 'sglang[all]'); nothing checked"
  exit 0
fi

MODEL=${TIDELOG_SGLANG_MODEL:-}
if [[ -z "$MODEL" ]]; then
  # The reference model as a publication writes it: config.json, model.safetensors, tokenizer files.
  REF=$(mktemp -d -t tidelog-reference-model-XXXXXX)
  "$PY" -c 'import sys; from workers.policy import Policy, save_weights
save_weights(Policy(seed=0), sys.argv[1] + "/initial", "initial")
save_weights(Policy(seed=1), sys.argv[1] + "/other", "other")' "$REF"
  MODEL="$REF/initial"
  export TIDELOG_SGLANG_OTHER_MODEL=${TIDELOG_SGLANG_OTHER_MODEL:-$REF/other}
fi
PORT=${TIDELOG_SGLANG_PORT:-$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
START_TIMEOUT=${TIDELOG_SGLANG_START_TIMEOUT:-600}
URL="http://127.0.0.1:${PORT}"
LOG=$(mktemp -t tidelog-sglang-XXXXXX.log)

# Memory release needs the memory saver; weights must come back with their values after a
# resume, which needs a CPU backup on builds that offer one (older builds keep them by default).
ARGS=(--model-path "$MODEL" --host 127.0.0.1 --port "$PORT" --enable-memory-saver
      --mem-fraction-static 0.3 --log-level warning)
HELP=$("$PY" -m sglang.launch_server --help 2>/dev/null || true)
if grep -q -- '--enable-weights-cpu-backup' <<<"$HELP"; then ARGS+=(--enable-weights-cpu-backup); fi
# shellcheck disable=SC2206  # word splitting of the extra arguments is intended
ARGS+=(${TIDELOG_SGLANG_EXTRA_ARGS:-})

echo "gpu_smoke: starting SGLang ($MODEL) on $URL; log: $LOG"
setsid "$PY" -m sglang.launch_server "${ARGS[@]}" >"$LOG" 2>&1 &
SERVER=$!

stop_server() {
  # The server runs in its own session (setsid), so its process group id is $SERVER: stop the
  # whole group (scheduler, detokenizer), also when the leader itself has already exited.
  if kill -0 -- "-$SERVER" 2>/dev/null; then
    kill -TERM -- "-$SERVER" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 -- "-$SERVER" 2>/dev/null || break; sleep 1; done
    kill -KILL -- "-$SERVER" 2>/dev/null || true
  fi
}
trap stop_server EXIT

deadline=$((SECONDS + START_TIMEOUT))
until "$PY" - "$URL" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1] + "/health", timeout=10) as r:
    sys.exit(0 if r.status == 200 else 1)
EOF
do
  if ! kill -0 "$SERVER" 2>/dev/null; then
    echo "gpu_smoke: SGLang exited before it was healthy; last log lines:"; tail -n 50 "$LOG"; exit 1
  fi
  if (( SECONDS > deadline )); then
    echo "gpu_smoke: SGLang not healthy within ${START_TIMEOUT}s; last log lines:"; tail -n 50 "$LOG"; exit 1
  fi
  sleep 2
done
echo "gpu_smoke: SGLang is healthy; running the adapter tests against it"

status=0
TIDELOG_SGLANG_URL="$URL" "$PY" -m pytest -q -p no:cacheprovider tests/workers/inference "$@" || status=$?
if (( status != 0 )); then echo "gpu_smoke: adapter tests failed; SGLang log: $LOG"; fi
exit "$status"
