#!/usr/bin/env bash
# Two builds of assistd-bench side by side, interleaved: end-to-end rate and the WAL written
# per message (pg_stat_wal around each run, less a run of one message, divided by N - 1), for
# a change measured before and after in one run. Issue 35 part 2.
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
# Prints "rate wal_records wal_bytes model_calls" of one run of binary $1 with N=$2
# (model_calls "-" from a build that does not print them).
run() {
  local before after line rate calls
  before="$(wal)"
  line="$("$1" end-to-end --db "$DB" --n "$2" | grep '^scenario=end-to-end')"
  rate="$(sed -E 's/.* rate=([0-9]+)\/s.*/\1/' <<<"$line")"
  calls="$(grep -oE 'model_calls=[0-9]+' <<<"$line" | cut -d= -f2 || true)"
  after="$(wal)"
  awk -v r="$rate" -v b="$before" -v a="$after" -v c="${calls:--}" \
    'BEGIN {split(b, x, " "); split(a, y, " "); print r, y[1] - x[1], y[2] - x[2], c}'
}
read -r _ BR0 BB0 _ <<<"$(run "$BEFORE" 1)"
read -r _ AR0 AB0 _ <<<"$(run "$AFTER" 1)"
per() { awk -v w="$1" -v base="$2" -v n="$N" 'BEGIN {printf "%.1f", (w - base) / (n - 1)}'; }
for pair in $(seq 1 "$PAIRS"); do
  read -r br bwr bwb bc <<<"$(run "$BEFORE" "$N")"
  read -r ar awr awb ac <<<"$(run "$AFTER" "$N")"
  echo "pair=$pair db=$DB n=$N before=$br/s after=$ar/s" \
    "before_wal_records_per_msg=$(per "$bwr" "$BR0") after_wal_records_per_msg=$(per "$awr" "$AR0")" \
    "before_wal_bytes_per_msg=$(per "$bwb" "$BB0") after_wal_bytes_per_msg=$(per "$awb" "$AB0")" \
    "before_model_calls=$bc after_model_calls=$ac"
done
echo "date=$(date -u +%FT%TZ) nproc=$(nproc)"
