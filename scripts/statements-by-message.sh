#!/usr/bin/env bash
# What PostgreSQL executes per answered message, statement by statement: runs `assistd-bench
# end-to-end --db postgres` once with its database kept, reads pg_stat_statements for that
# database alone (its new oid; start-up, migrations and the bench's GIN merge included) and
# prints, per message, the statements, transactions, execution time and WAL, then each
# statement's calls, rows, execution time and WAL (the costliest first), then drops the
# database. Needs pg_stat_statements loaded (it says how when it is not). Issue 35 part 2.
#
#   scripts/statements-by-message.sh [N] [TOP]  # needs ASSISTD_BENCH_POSTGRES_URL (a superuser URL)
#
# ASSISTD_BENCH_BIN names an assistd-bench to run instead of building the release one.
set -euo pipefail
N="${1:-5000}"
TOP="${2:-15}"
URL="${ASSISTD_BENCH_POSTGRES_URL:?set ASSISTD_BENCH_POSTGRES_URL}"
loaded="$(psql "$URL" -Atc "SELECT setting ~ 'pg_stat_statements' FROM pg_settings
  WHERE name = 'shared_preload_libraries'")"
if [ "$loaded" != t ]; then
  echo "pg_stat_statements is not loaded: ALTER SYSTEM SET shared_preload_libraries =" \
    "'pg_stat_statements'; restart PostgreSQL; run again (ALTER SYSTEM RESET" \
    "shared_preload_libraries and a restart undo it)" >&2
  exit 2
fi
BENCH="${ASSISTD_BENCH_BIN:-}"
if [ -z "$BENCH" ]; then
  cargo build --release --locked --bin assistd-bench >&2
  BENCH=./target/release/assistd-bench
fi
psql "$URL" -qAtc "CREATE EXTENSION IF NOT EXISTS pg_stat_statements" >/dev/null
out="$(ASSISTD_BENCH_KEEP_DB=1 "$BENCH" end-to-end --db postgres --n "$N")"
echo "$out" | grep '^scenario=' >&2
db="$(echo "$out" | sed -n 's/^kept_database=//p')"
[ -n "$db" ] || { echo "the bench kept no database" >&2; exit 1; }
STATEMENTS="$(mktemp)"
# The kept database and the temporary file go whatever happens from here.
trap 'rm -f "$STATEMENTS"; psql "$URL" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
oid="$(psql "$URL" -Atc "SELECT oid FROM pg_database WHERE datname = '$db'")"
# Top-level statements only: those inside the rollup triggers are part of the statement that
# fired them (and are counted apart only with pg_stat_statements.track = 'all').
psql "$URL" -qAt -F $'\t' -c "SELECT
    CASE WHEN query IN ('BEGIN', 'COMMIT', 'ROLLBACK') THEN query ELSE 'statement' END,
    calls, rows, total_exec_time, wal_records, wal_bytes,
    regexp_replace(left(query, 100), '\s+', ' ', 'g')
  FROM pg_stat_statements WHERE dbid = $oid AND toplevel" > "$STATEMENTS"
awk -F'\t' -v n="$N" -v top="$TOP" '
  { calls[$1] += $2; ms += $4; wr += $5; wb += $6 }
  $1 == "statement" { line[++s] = sprintf("%9.3f %9.3f %9.4f %8.2f %8.0f  %s", $2 / n, $3 / n, $4 / n, $5 / n, $6 / n, $7) }
  END {
    printf "per message (N = %d): %.3f statements, %.3f transactions (BEGIN), %.4f ms executed, %.2f WAL records, %.0f WAL bytes\n",
      n, calls["statement"] / n, calls["BEGIN"] / n, ms / n, wr / n, wb / n
    printf "%9s %9s %9s %8s %8s  %s\n", "calls", "rows", "ms", "wal rec", "wal B", "statement (per message, costliest first)"
    fflush()
    sorted = "sort -k3 -gr | head -n " top
    for (i = 1; i <= s; i++) print line[i] | sorted
    close(sorted)
  }' "$STATEMENTS"
