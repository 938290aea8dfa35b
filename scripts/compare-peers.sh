#!/usr/bin/env bash
# assistd side by side with the peer queue (apalis 1.0 from crates.io, ../shared/peers/queue-bench):
# assistd-bench end-to-end and the peer's e2e, alternating, PAIRS pairs, on one machine in one run;
# prints every pair, then the medians and the ratio. Issue 22.
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

ours=()
theirs=()
for pair in $(seq 1 "$PAIRS"); do
  line="$(./target/release/assistd-bench end-to-end --db "$DB" --n "$N" --concurrency "$CONCURRENCY" | grep '^scenario=end-to-end')"
  a="$(sed -E 's/.* rate=([0-9]+)\/s.*/\1/' <<<"$line")"
  line="$(QB_N="$N" QB_REPS=1 QB_MEASURES=e2e QB_PEERS="$PEER" QB_PRODUCERS="$CONCURRENCY" \
    QB_CONCURRENCY="$CONCURRENCY" target/peers/release/queue-bench "${PEER_ARGS[@]}" 2>/dev/null \
    | grep '^RESULT' | grep 'measure=e2e')"
  p="$(sed -E 's/.*median= *([0-9]+) jobs\/s.*/\1/' <<<"$line")"
  ours+=("$a")
  theirs+=("$p")
  echo "pair=$pair db=$DB n=$N assistd_end_to_end=$a/s ${PEER}_e2e=$p/s ratio=$(awk -v a="$a" -v p="$p" 'BEGIN {printf "%.2f", a / p}')"
done
ma="$(printf '%s\n' "${ours[@]}" | median)"
mp="$(printf '%s\n' "${theirs[@]}" | median)"
echo "median db=$DB n=$N pairs=$PAIRS assistd_end_to_end=$ma/s ${PEER}_e2e=$mp/s ratio=$(awk -v a="$ma" -v p="$mp" 'BEGIN {printf "%.2f", a / p}') date=$(date -u +%FT%TZ) nproc=$(nproc)"
