#!/bin/sh
# redis.conf for the compose stacks, on stdout: one ACL user per role, each allowed only
# the keys its role needs (a leaked service secret cannot rewrite the policy pointer,
# the learner's counters or another role's streams), and the default user for operators
# and the healthcheck. Passwords come from the environment and are written as SHA-256.
#
#   default  REDIS_PASSWORD          everything (operators, redis-cli, the healthcheck)
#   learner  REDIS_LEARNER_PASSWORD  every key of the run (prefix), no dangerous command
#   rollout  REDIS_ROLLOUT_PASSWORD  reads the run's keys; writes the task and group
#                                    streams, the dead stream, failures, its registration
#   scorer   REDIS_SCORER_PASSWORD   reads the policy pointer; writes its registration
#
# MEMPO_KEY_PREFIX: the services' key prefix (default mempo:). Used by the compose files
# (mounted into the redis container) and tested in tests/core/test_redis_acl.py.
set -eu
prefix=${MEMPO_KEY_PREFIX:-mempo:}
hash() { printf '%s' "$1" | sha256sum | cut -d' ' -f1; }
for name in REDIS_PASSWORD REDIS_LEARNER_PASSWORD REDIS_ROLLOUT_PASSWORD REDIS_SCORER_PASSWORD; do
  eval "value=\${$name:-}"
  [ -n "$value" ] || { echo "redis-conf: set $name" >&2; exit 2; }
done
echo "user default on #$(hash "$REDIS_PASSWORD") ~* &* +@all"
echo "user learner on #$(hash "$REDIS_LEARNER_PASSWORD") resetchannels ~${prefix}* +@all -@dangerous"
echo "user rollout on #$(hash "$REDIS_ROLLOUT_PASSWORD") resetchannels %R~${prefix}* %W~${prefix}tasks" \
  "%W~${prefix}groups %W~${prefix}dead %W~${prefix}failures %W~${prefix}engines:* +@all -@dangerous"
echo "user scorer on #$(hash "$REDIS_SCORER_PASSWORD") resetchannels %R~${prefix}policy %RW~${prefix}engines:*" \
  "+@all -@dangerous"
