#!/usr/bin/env bash
# One rollout replica: an engine and its worker in the same container, so that
# `docker compose up --scale rollout=N` gives N engine + worker pairs.
#
#   ENGINE=sglang    python -m sglang.launch_server on $MODEL (the GPU image's default)
#   ENGINE=cpu       mempo rollout engine (transformers on CPU; $MODEL or the tiny model)
#   ENGINE=external  no engine here: the worker uses MEMPO_ROLLOUT_ENGINE_URL (the CPU image's default)
#
# The engine listens on 127.0.0.1 inside the container only (SGLang's /server_info shows
# its admin key to anyone who reaches it): nothing outside the replica reaches it. Its key
# (MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN; random per start when unset) stays in the container.
# The learner updates the engine through the worker: POST /update_weights_from_disk on
# the worker's port, with the worker's own token (MEMPO_ROLLOUT_ADMIN_TOKEN); the worker
# registers that URL (MEMPO_ROLLOUT_PUBLIC_URL, this container's IP) in Redis.
#
# The worker waits for the engine's /health, then serves; if either process exits, the
# other is stopped and the container exits with its code (the orchestrator restarts the
# pair). SIGTERM is passed on to both (the worker drains its in-flight tasks).
# Environment: MODEL, ENGINE_PORT (30000), SGLANG_ARGS (extra launch_server flags),
# WEIGHTS_ROOT (/weights: the CPU engine loads weight updates only from inside it),
# MEMPO_ROLLOUT_* (the worker's settings; docs/rollout.md).
set -euo pipefail

ENGINE=${ENGINE:-external}
ENGINE_PORT=${ENGINE_PORT:-30000}
SELF_IP=$(hostname -i 2>/dev/null | awk '{print $1}')
SELF_IP=${SELF_IP:-$(hostname)}

if [ "$ENGINE" != "external" ]; then
  export MEMPO_ROLLOUT_ENGINE_URL=${MEMPO_ROLLOUT_ENGINE_URL:-http://127.0.0.1:${ENGINE_PORT}}
  if [ -z "${MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN:-}" ]; then
    MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(32))')
    export MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN
  fi
fi
export MEMPO_ROLLOUT_HOST=${MEMPO_ROLLOUT_HOST:-0.0.0.0}
export MEMPO_ROLLOUT_PUBLIC_URL=${MEMPO_ROLLOUT_PUBLIC_URL:-http://${SELF_IP}:${MEMPO_ROLLOUT_PORT:-8003}}
export MEMPO_ROLLOUT_WORKER_ID=${MEMPO_ROLLOUT_WORKER_ID:-$(hostname)}

pids=()
stop_all() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
}
trap 'stop_all' TERM INT

case "$ENGINE" in
  sglang)
    : "${MODEL:?set MODEL to the HF model folder (for example /weights/v0) or hub id}"
    # The admin key goes in a 0600 config file (SGLang's --config YAML), never on the
    # command line, where any process of the container could read it.
    sglang_config=$(mktemp "${TMPDIR:-/tmp}/sglang-XXXXXX.yaml")
    python3 -c 'import json, os; print("admin-api-key: " + json.dumps(os.environ["MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN"]))' \
      > "$sglang_config"
    # shellcheck disable=SC2086  # SGLANG_ARGS is a list of flags
    python3 -m sglang.launch_server --config "$sglang_config" --model-path "$MODEL" --host 127.0.0.1 \
      --port "$ENGINE_PORT" --weight-version 0 ${SGLANG_ARGS:-} &
    pids+=($!)
    ;;
  cpu)
    export MEMPO_ENGINE_HOST=127.0.0.1 MEMPO_ENGINE_PORT="$ENGINE_PORT"
    # Weight updates only from the shared weights volume (an engine without a root
    # refuses every update): WEIGHTS_ROOT, default /weights as the compose file mounts it.
    export MEMPO_ENGINE_WEIGHTS_ROOT="${MEMPO_ENGINE_WEIGHTS_ROOT:-${WEIGHTS_ROOT:-/weights}}"
    [ -n "${MODEL:-}" ] && export MEMPO_ENGINE_MODEL_PATH="$MODEL"
    export MEMPO_ENGINE_ADMIN_TOKEN="$MEMPO_ROLLOUT_ENGINE_ADMIN_TOKEN"
    mempo rollout engine &
    pids+=($!)
    ;;
  external) ;;
  *) echo "entrypoint: ENGINE must be sglang, cpu or external (got '$ENGINE')" >&2; exit 2 ;;
esac

if [ "$ENGINE" != "external" ]; then
  echo "entrypoint: waiting for the $ENGINE engine on port $ENGINE_PORT"
  python3 - "$MEMPO_ROLLOUT_ENGINE_URL" "${ENGINE_WAIT_S:-1800}" "${pids[0]}" <<'PY'
import os, sys, time, urllib.request
url, limit, pid = sys.argv[1].rstrip("/") + "/health", float(sys.argv[2]), int(sys.argv[3])
deadline = time.monotonic() + limit
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("entrypoint: the engine exited before it was healthy")
    try:
        if urllib.request.urlopen(url, timeout=30).status == 200:
            sys.exit(0)
    except Exception:
        pass
    time.sleep(2)
sys.exit(f"entrypoint: {url} not healthy after {limit:.0f}s")
PY
fi

mempo rollout worker &
pids+=($!)

# The first process to exit decides; stop the other one and exit with its code.
set +e
wait -n "${pids[@]}"
code=$?
stop_all
wait
exit "$code"
