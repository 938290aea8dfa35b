"""Checks the shipped Dockerfile and docker-compose.yml (issue 23); no Docker engine needed.

    python3 check_deploy.py check <Dockerfile> <docker-compose.yml>
        prints one problem per line; exit 1 when there is any
    python3 check_deploy.py env <docker-compose.yml> <service> VAR=value ...
        prints the service's environment as compose would give it (anchors and merge keys
        resolved by PyYAML, ${VAR}, ${VAR:-default} and ${VAR:?message} substituted from the
        given values; a required variable that is missing is an error, as in compose), as JSON
"""

import json
import re
import sys

import yaml

VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def substitute(text, values):
    def one(m):
        name, op, arg = m.group(1), m.group(2), m.group(3)
        given = values.get(name)
        if op in (":?", "?") and not given:
            raise SystemExit(f"required variable {name}: {arg}")
        if given:
            return given
        return arg if op in (":-", "-") else ""

    return VAR.sub(one, text)


def dockerfile_problems(text):
    problems = []
    lines = []
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    stages = [i for i, line in enumerate(lines) if line.upper().startswith("FROM ")]
    if len(stages) < 2:
        problems.append("Dockerfile: a build stage and a runtime stage are expected")
        return problems
    build, final = lines[stages[0]:stages[-1]], lines[stages[-1]:]
    copies = [line for line in build if line.upper().startswith("COPY ")]
    manifests = next((i for i, c in enumerate(copies) if "Cargo.lock" in c and " . " not in c + " "), None)
    everything = next((i for i, c in enumerate(copies) if re.match(r"COPY\s+\.\s+\.", c, re.I)), None)
    if manifests is None or everything is None or manifests > everything:
        problems.append("Dockerfile: Cargo.toml and Cargo.lock must be copied (and built) before the code")
    else:
        between = build[build.index(copies[manifests]):build.index(copies[everything])]
        if not any(line.upper().startswith("RUN ") and "cargo build" in line for line in between):
            problems.append("Dockerfile: the dependencies must be built in a layer before the code is copied")
    users = [line.split(None, 1)[1] for line in final if line.upper().startswith("USER ")]
    if not users or users[-1].split(":")[0] in ("root", "0"):
        problems.append("Dockerfile: the runtime stage must run as a non-root USER")
    checks = [line for line in final if line.upper().startswith("HEALTHCHECK ")]
    if not checks or "/readyz" not in checks[-1]:
        problems.append("Dockerfile: a HEALTHCHECK on /readyz is expected")
    if not any(line.upper().startswith("COPY ") and "config/" in line for line in final):
        problems.append("Dockerfile: config/ (the examples and workflows) must be copied in")
    return problems


def compose_problems(text):
    problems = []
    if "change-me" in text:
        problems.append("compose: a `change-me` default secret")
    doc = yaml.safe_load(text)
    services = doc.get("services") or {}
    if "postgres" not in services:
        problems.append("compose: no postgres service")
    for name, service in services.items():
        if service.get("restart") not in ("always", "unless-stopped", "on-failure"):
            problems.append(f"compose: service {name} has no restart policy")
        check = service.get("healthcheck") or {}
        if not check.get("test"):
            problems.append(f"compose: service {name} has no healthcheck")
        if name.startswith("assistd"):
            if "/readyz" not in json.dumps(check.get("test")):
                problems.append(f"compose: service {name}'s healthcheck is not /readyz")
            for port in service.get("ports") or []:
                if not str(port).startswith("127.0.0.1:"):
                    problems.append(f"compose: service {name} publishes {port} beyond the host's loopback")
            depends = service.get("depends_on") or {}
            if (depends.get("postgres") or {}).get("condition") != "service_healthy":
                problems.append(f"compose: service {name} does not wait for a healthy postgres")
    for secret in ("ASSISTD_ADMIN__TOKEN", "ASSISTD_CHANNELS__GENERIC__SECRET", "POSTGRES_PASSWORD"):
        if not re.search(r"\$\{" + secret + r":\?", text):
            problems.append(f"compose: {secret} must be required (${{{secret}:?...}}), not defaulted")
    return problems


def main():
    if sys.argv[1] == "check":
        with open(sys.argv[2]) as f:
            problems = dockerfile_problems(f.read())
        with open(sys.argv[3]) as f:
            problems += compose_problems(f.read())
        for p in problems:
            print(p)
        sys.exit(1 if problems else 0)
    if sys.argv[1] == "env":
        values = dict(a.split("=", 1) for a in sys.argv[4:])
        with open(sys.argv[2]) as f:
            doc = yaml.safe_load(substitute(f.read(), values))
        env = doc["services"][sys.argv[3]].get("environment") or {}
        print(json.dumps({k: "" if v is None else str(v) for k, v in env.items()}))
        return
    raise SystemExit(f"unknown command {sys.argv[1]}")


if __name__ == "__main__":
    main()
