"""Parses an OpenMetrics exposition (stdin) with the Prometheus project's own Python parser
(prometheus-client from PyPI, installed by .ci/run) and prints its families as JSON:
{name: {"type": ..., "unit": ..., "samples": [[sample_name, labels, value], ...]}}.
The parser is strict: a missing `# EOF`, a sample without its family, a counter sample
without `_total`, a bad escape or a duplicate sample fails it, with a non-zero exit."""
import json
import sys

from prometheus_client.openmetrics.parser import text_string_to_metric_families

families = {}
for family in text_string_to_metric_families(sys.stdin.read()):
    families[family.name] = {
        "type": family.type,
        "unit": family.unit,
        "samples": [[s.name, s.labels, s.value] for s in family.samples],
    }
json.dump(families, sys.stdout)
