#!/usr/bin/env bash
# Where an end-to-end run's WAL goes, by relation (table, index, TOAST) and by kind of record:
# runs `assistd-bench end-to-end --db postgres` once with its database kept, reads the WAL
# between the LSNs before and after with pg_walinspect (PostgreSQL 15+), names each record's
# first block's relation in the kept database, prints records and bytes per message, then
# drops the database. The catalogs the new database was copied with are left out. Issue 35
# part 2.
#
#   scripts/wal-by-relation.sh [N]     # needs ASSISTD_BENCH_POSTGRES_URL (a superuser URL)
#
# ASSISTD_BENCH_BIN names an assistd-bench to run instead of building the release one.
set -euo pipefail
N="${1:-2000}"
URL="${ASSISTD_BENCH_POSTGRES_URL:?set ASSISTD_BENCH_POSTGRES_URL}"
BENCH="${ASSISTD_BENCH_BIN:-}"
if [ -z "$BENCH" ]; then
  cargo build --release --locked --bin assistd-bench >&2
  BENCH=./target/release/assistd-bench
fi
psql "$URL" -qAtc "CREATE EXTENSION IF NOT EXISTS pg_walinspect" >/dev/null
start="$(psql "$URL" -Atc "SELECT pg_current_wal_insert_lsn()")"
out="$(ASSISTD_BENCH_KEEP_DB=1 "$BENCH" end-to-end --db postgres --n "$N")"
sleep 1  # pg_walinspect reads only up to what is flushed
end="$(psql "$URL" -Atc "SELECT pg_current_wal_flush_lsn()")"
echo "$out" | grep '^scenario=' >&2
db="$(echo "$out" | sed -n 's/^kept_database=//p')"
[ -n "$db" ] || { echo "the bench kept no database" >&2; exit 1; }
NAMES="$(mktemp)"
RECORDS="$(mktemp)"
# The kept database and the temporary files go whatever happens from here.
trap 'rm -f "$NAMES" "$RECORDS"; psql "$URL" -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)"' EXIT
dburl="${URL%/*}/$db"
oid="$(psql "$URL" -Atc "SELECT oid FROM pg_database WHERE datname = '$db'")"
# relfilenode -> name, in the kept database (a TOAST table is named after its table).
psql "$dburl" -Atc "SELECT c.relfilenode, COALESCE(t.relname || ' (toast)', c.relname)
  FROM pg_class c LEFT JOIN pg_class t ON t.reltoastrelid = c.oid
  LEFT JOIN pg_index i ON i.indexrelid = c.oid
  WHERE c.relfilenode <> 0" > "$NAMES"
psql "$URL" -qAt -F $'\t' -c "SELECT COALESCE(substring(block_ref from 'rel [0-9]+/$oid/([0-9]+)'), '-'),
    resource_manager || ':' || split_part(record_type, ' ', 1), count(*), sum(record_length), sum(fpi_length)
  FROM pg_get_wal_records_info('$start', '$end')
  GROUP BY 1, 2 ORDER BY 4 DESC" > "$RECORDS"
awk -F'\t' -v n="$N" -v names="$NAMES" '
  BEGIN { while ((getline l < names) > 0) { split(l, f, "|"); name[f[1]] = f[2] } }
  { rel = ($1 in name) ? name[$1] : ($1 == "-" ? "(no relation)" : "rel " $1);
    # Catalogs of the new database (CREATE DATABASE copies them through the WAL): not per message.
    if (rel ~ /^(pg_|sql_|_sqlx)/ || ($1 != "-" && $1 + 0 < 16384)) next
    r[rel] += $3; b[rel] += $4; kr[rel " " $2] += $3; kb[rel " " $2] += $4; R += $3; B += $4; F += $5 }
  END {
    printf "%-48s %10s %10s\n", "relation", "records/msg", "bytes/msg"
    for (k in r) if (b[k] / n >= 1) printf "%-48s %10.2f %10.0f\n", k, r[k] / n, b[k] / n | "sort -k3 -nr"
    close("sort -k3 -nr")
    printf "%-48s %10.2f %10.0f\n", "TOTAL", R / n, B / n
    printf "%-48s %10s %10.0f\n", "of which full-page images", "", F / n
    print ""
    printf "%-64s %10s %10s\n", "relation and record", "records/msg", "bytes/msg"
    for (k in kr) if (kb[k] / n >= 20) printf "%-64s %10.2f %10.0f\n", k, kr[k] / n, kb[k] / n | "sort -k4 -nr"
  }' "$RECORDS"
