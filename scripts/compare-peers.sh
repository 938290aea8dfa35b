#!/usr/bin/env bash
# assistd side by side with the peer queue (apalis 1.0 from crates.io, ../shared/peers/queue-bench):
# assistd-bench end-to-end and the peer's e2e, alternating, PAIRS pairs, on one machine in one run;
# prints every pair, then the medians and the ratio. Issue 22. On PostgreSQL each run also
# reports the WAL it wrote per message / job (pg_stat_wal, records and bytes, read with psql
# around the run), less what a run of one message / job writes (creating its database and
# schema), divided by N - 1, and the CPU the local PostgreSQL cluster used per message / job
# (its processes' /proc times, with what the postmaster reaped from ended backends). Issue 35.
#
#   scripts/compare-peers.sh sqlite   [N] [PAIRS]
#   scripts/compare-peers.sh postgres [N] [PAIRS]    # needs ASSISTD_BENCH_POSTGRES_URL (an admin URL:
#                                                      # both programs create and drop their own databases)
#
# Environment: PEERS_DIR (default ../shared/peers/queue-bench), PEER (default apalis),
# CONCURRENCY (default 64, both sides: producers and, for the peer, worker concurrency).
set -euo pipefail

DB="${1:?usage: compare-peers.sh sqlite|postgres [N] [PAIRS]}"
N="${2:-5000}"
PAIRS="${3:-3}"
PEERS_DIR="${PEERS_DIR:-../shared/peers/queue-bench}"
PEER="${PEER:-apalis}"
CONCURRENCY="${CONCURRENCY:-64}"
case "$DB" in
  sqlite) PEER_ARGS=(sqlite) ;;
  postgres)
    : "${ASSISTD_BENCH_POSTGRES_URL:?set ASSISTD_BENCH_POSTGRES_URL for postgres}"
    PEER_ARGS=(postgres "$ASSISTD_BENCH_POSTGRES_URL") ;;
  *) echo "db must be sqlite or postgres" >&2; exit 2 ;;
esac

cargo build --release --locked --bin assistd-bench >&2
cargo build --release --locked --manifest-path "$PEERS_DIR/Cargo.toml" --target-dir target/peers >&2

median() { sort -n | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }

# The cluster's WAL so far: "records bytes" (PostgreSQL only).
wal() {
  [ "$DB" = postgres ] || { echo "0 0"; return; }
  psql "$ASSISTD_BENCH_POSTGRES_URL" -Atc "SELECT wal_records || ' ' || wal_bytes FROM pg_stat_wal"
}
ours_run() {
  ./target/release/assistd-bench end-to-end --db "$DB" --n "$1" --concurrency "$CONCURRENCY" \
    | grep '^scenario=end-to-end' | sed -E 's/.* rate=([0-9]+)\/s.*/\1/'
}
theirs_run() {
  QB_N="$1" QB_REPS=1 QB_MEASURES=e2e QB_PEERS="$PEER" QB_PRODUCERS="$CONCURRENCY" \
    QB_CONCURRENCY="$CONCURRENCY" target/peers/release/queue-bench "${PEER_ARGS[@]}" 2>/dev/null \
    | grep '^RESULT' | grep 'measure=e2e' | sed -E 's/.*median= *([0-9]+) jobs\/s.*/\1/'
}
# CPU milliseconds the local PostgreSQL cluster has used: every live postgres process's user
# and system time, plus what the postmaster reaped from backends that ended (its children's
# times). Linux /proc, 100 ticks a second.
pgcpu() {
  [ "$DB" = postgres ] || { echo 0; return; }
  local total=0 pid comm fields
  for stat in /proc/[0-9]*/stat; do
    pid="${stat#/proc/}"; pid="${pid%/stat}"
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || continue
    [ "$comm" = postgres ] || continue
    fields="$(sed -E 's/^.*\) //' "$stat" 2>/dev/null)" || continue
    # After the name: state, ppid, ...; utime, stime, cutime, cstime are 12-15. The
    # postmaster (whose parent is not postgres) adds its reaped backends' times.
    local parent
    parent="$(cat "/proc/$(echo "$fields" | awk '{print $2}')/comm" 2>/dev/null || true)"
    total=$(awk -v t="$total" -v f="$fields" -v pm="$([ "$parent" = postgres ] && echo 0 || echo 1)" \
      'BEGIN { split(f, x, " "); print t + (x[12] + x[13] + pm * (x[14] + x[15])) * 10 }')
  done
  echo "$total"
}
# Runs "$@" (printing its rate) and sets WAL_RECORDS and WAL_BYTES to what the cluster wrote
# and PG_CPU_MS to the CPU it used meanwhile.
measured() {
  local before after cpu_before
  before="$(wal)"
  cpu_before="$(pgcpu)"
  RATE="$("$@")"
  PG_CPU_MS="$(awk -v a="$(pgcpu)" -v b="$cpu_before" 'BEGIN {print a - b}')"
  after="$(wal)"
  read -r WAL_RECORDS WAL_BYTES <<<"$(awk -v b="$before" -v a="$after" \
    'BEGIN {split(b, x, " "); split(a, y, " "); print y[1] - x[1], y[2] - x[2]}')"
}
per() { awk -v w="$1" -v base="$2" -v n="$N" 'BEGIN {printf "%.1f", (w - base) / (n - 1)}'; }

if [ "$DB" = postgres ]; then
  # What one message / job writes with its database and schema: taken off every run.
  measured ours_run 1; OURS_BASE_R=$WAL_RECORDS; OURS_BASE_B=$WAL_BYTES
  measured theirs_run 1; THEIRS_BASE_R=$WAL_RECORDS; THEIRS_BASE_B=$WAL_BYTES
fi

ours=()
theirs=()
for pair in $(seq 1 "$PAIRS"); do
  measured ours_run "$N"; a=$RATE
  wal_ours=""
  [ "$DB" = postgres ] && wal_ours=" assistd_wal_records_per_msg=$(per "$WAL_RECORDS" "$OURS_BASE_R") assistd_wal_bytes_per_msg=$(per "$WAL_BYTES" "$OURS_BASE_B") assistd_pg_cpu_ms_per_msg=$(awk -v c="$PG_CPU_MS" -v n="$N" 'BEGIN {printf "%.3f", c / n}')"
  measured theirs_run "$N"; p=$RATE
  wal_theirs=""
  [ "$DB" = postgres ] && wal_theirs=" ${PEER}_wal_records_per_job=$(per "$WAL_RECORDS" "$THEIRS_BASE_R") ${PEER}_wal_bytes_per_job=$(per "$WAL_BYTES" "$THEIRS_BASE_B") ${PEER}_pg_cpu_ms_per_job=$(awk -v c="$PG_CPU_MS" -v n="$N" 'BEGIN {printf "%.3f", c / n}')"
  ours+=("$a")
  theirs+=("$p")
  echo "pair=$pair db=$DB n=$N assistd_end_to_end=$a/s ${PEER}_e2e=$p/s ratio=$(awk -v a="$a" -v p="$p" 'BEGIN {printf "%.2f", a / p}')$wal_ours$wal_theirs"
done
ma="$(printf '%s\n' "${ours[@]}" | median)"
mp="$(printf '%s\n' "${theirs[@]}" | median)"
echo "median db=$DB n=$N pairs=$PAIRS assistd_end_to_end=$ma/s ${PEER}_e2e=$mp/s ratio=$(awk -v a="$ma" -v p="$mp" 'BEGIN {printf "%.2f", a / p}') date=$(date -u +%FT%TZ) nproc=$(nproc)"
