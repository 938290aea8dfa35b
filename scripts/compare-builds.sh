#!/usr/bin/env bash
# Two builds of assistd-bench side by side, interleaved: end-to-end rate and the WAL written
# per message (pg_stat_wal around each run, less a run of one message, divided by N - 1), for
# a change measured before and after in one run, and the CPU the PostgreSQL server's processes
# used per message (their /proc times around each run; "-" when no local process of user
# postgres can be read, e.g. a server on another machine). Issue 35 part 2.
#
#   scripts/compare-builds.sh BEFORE_BIN AFTER_BIN postgres|sqlite [N] [PAIRS]
#   # e.g. build the old commit in a worktree, copy its target/release/assistd-bench aside
#   # (cargo may reuse artefacts across worktrees sharing a target dir: touch src/lib.rs)
set -euo pipefail
BEFORE="${1:?before binary}"
AFTER="${2:?after binary}"
DB="${3:?postgres|sqlite}"
N="${4:-5000}"
PAIRS="${5:-3}"
URL="${ASSISTD_BENCH_POSTGRES_URL:-}"
[ "$DB" = sqlite ] || : "${URL:?set ASSISTD_BENCH_POSTGRES_URL}"
wal() {
  [ "$DB" = postgres ] || { echo "0 0"; return; }
  psql "$URL" -Atc "SELECT wal_records || ' ' || wal_bytes FROM pg_stat_wal"
}
# CPU clock ticks (user + system, with waited-for children) of the local PostgreSQL
# processes; empty when there are none to read.
pg_ticks() {
  [ "$DB" = postgres ] || return 0
  local pids
  pids="$(pgrep -u postgres 2>/dev/null || true)"
  [ -n "$pids" ] || return 0
  for p in $pids; do cat "/proc/$p/stat" 2>/dev/null || true; done |
    awk '{t += $14 + $15 + $16 + $17} END {print t + 0}'
}
# Prints "rate wal_records wal_bytes model_calls pg_cpu_ms_per_msg" of one run of binary $1
# with N=$2 (model_calls "-" from a build that does not print them; the CPU "-" as above).
run() {
  local before after line rate calls t0 t1
  before="$(wal)"
  t0="$(pg_ticks)"
  line="$("$1" end-to-end --db "$DB" --n "$2" | grep '^scenario=end-to-end')"
  t1="$(pg_ticks)"
  rate="$(sed -E 's/.* rate=([0-9]+)\/s.*/\1/' <<<"$line")"
  calls="$(grep -oE 'model_calls=[0-9]+' <<<"$line" | cut -d= -f2 || true)"
  after="$(wal)"
  awk -v r="$rate" -v b="$before" -v a="$after" -v c="${calls:--}" -v t0="${t0:--}" \
    -v t1="${t1:--}" -v n="$2" -v hz="$(getconf CLK_TCK)" 'BEGIN {
      split(b, x, " "); split(a, y, " ")
      cpu = (t0 == "-" || t1 == "-") ? "-" : sprintf("%.2f", (t1 - t0) * 1000 / hz / n)
      print r, y[1] - x[1], y[2] - x[2], c, cpu }'
}
read -r _ BR0 BB0 _ <<<"$(run "$BEFORE" 1)"
read -r _ AR0 AB0 _ <<<"$(run "$AFTER" 1)"
per() { awk -v w="$1" -v base="$2" -v n="$N" 'BEGIN {printf "%.1f", (w - base) / (n - 1)}'; }
for pair in $(seq 1 "$PAIRS"); do
  read -r br bwr bwb bc bcpu <<<"$(run "$BEFORE" "$N")"
  read -r ar awr awb ac acpu <<<"$(run "$AFTER" "$N")"
  echo "pair=$pair db=$DB n=$N before=$br/s after=$ar/s" \
    "before_wal_records_per_msg=$(per "$bwr" "$BR0") after_wal_records_per_msg=$(per "$awr" "$AR0")" \
    "before_wal_bytes_per_msg=$(per "$bwb" "$BB0") after_wal_bytes_per_msg=$(per "$awb" "$AB0")" \
    "before_model_calls=$bc after_model_calls=$ac" \
    "before_pg_cpu_ms_per_msg=$bcpu after_pg_cpu_ms_per_msg=$acpu"
done
echo "date=$(date -u +%FT%TZ) nproc=$(nproc)"
