#!/bin/sh
# Redis for the rtrl stack: one ACL user per service, each limited to the keys it uses,
# so a service (or whoever holds its password) cannot write what steers another one:
# key records are the operator's alone, weight manifests weight_sync's, served-rollout
# bindings the serving API's. The default user is off. Passwords come from the
# environment; the generated ACL file is owner-only. tests/ops/test_redis_acl.py runs this
# script against a real redis-server and attacks each user.
#
#   RTRL_REDIS_PASSWORD_<USER>=... sh redis-acl.sh [extra redis-server arguments]
set -eu
acl="${RTRL_REDIS_ACL_FILE:-/tmp/rtrl-users.acl}"
umask 077
# Every service: plain reads and writes, scripts and transactions on its keys; nothing
# that reaches outside them (KEYS, FLUSHALL, CONFIG, DEBUG, ...: @dangerous).
base="resetkeys resetchannels -@all +@read +@write +@scripting +@transaction +@connection -@dangerous"
beat="~rtrl:hb:*"
{
  echo "user default off"
  echo "user operator on >${RTRL_REDIS_PASSWORD_OPERATOR:?} ~* &* +@all"
  # The gateway: dedup claims, its in-flight records, rate buckets, privacy counters; it
  # reads key records and which client a rollout was served to. Its claim script names the
  # private-users set among its keys, and Redis checks a script's keys for writing, so
  # the gateway holds that set too (Redis ACLs cannot grant SADD without SREM).
  echo "user ingest on >${RTRL_REDIS_PASSWORD_INGEST:?} $base $beat ~rtrl:ingest:event:* ~rtrl:ingest:inflight ~rtrl:ingest:bucket:* ~rtrl:privacy:* ~rtrl:ingest:private-users %R~rtrl:ingest:key:* %R~rtrl:ingest:client:* %R~rtrl:served:*"
  # The serving API: reads key records and the private-users set, spends rate buckets,
  # records which client each rollout was served to and which versions it applied.
  echo "user inference on >${RTRL_REDIS_PASSWORD_INFERENCE:?} $base $beat ~rtrl:ingest:bucket:* %W~rtrl:served:* ~rtrl:applied:* %R~rtrl:ingest:key:* %R~rtrl:ingest:private-users"
  # The weight registry, and the channels that announce its versions.
  echo "user weight_sync on >${RTRL_REDIS_PASSWORD_WEIGHT_SYNC:?} $base +@pubsub $beat ~rtrl:ws:* &rtrl:ws:*"
  # The rest only say they are alive.
  echo "user trainer on >${RTRL_REDIS_PASSWORD_TRAINER:?} $base $beat"
  echo "user reward_stream on >${RTRL_REDIS_PASSWORD_REWARD_STREAM:?} $base $beat"
  echo "user analytics on >${RTRL_REDIS_PASSWORD_ANALYTICS:?} $base $beat"
} > "$acl"
exec redis-server --aclfile "$acl" "$@"
