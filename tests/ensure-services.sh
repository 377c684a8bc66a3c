#!/usr/bin/env bash
# Start the local services the tests talk to, if they are not already running (idempotent).
# Today the engine tests need none; Redis is ensured for the job store and Celery tests.
set -euo pipefail

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

if ! port_open 6379; then
  if ! command -v redis-server >/dev/null; then
    echo "redis-server is not installed: apt-get install -y redis-server" >&2
    exit 1
  fi
  mkdir -p /tmp/prfaas-redis
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp/prfaas-redis --logfile /tmp/prfaas-redis/redis.log
  for _ in $(seq 50); do port_open 6379 && break; sleep 0.1; done
  port_open 6379 || { echo "redis-server did not start on 127.0.0.1:6379" >&2; exit 1; }
fi
echo "services ready: redis 127.0.0.1:6379"
